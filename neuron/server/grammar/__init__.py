"""Structured output on the API side: client grammars compiled in sandboxed workers (``worker``)
within limits (``limits``), their matchers and masks packed for the ranks (``grammars``,
``budget``), and the token constraints a request's planning composes (``constraints``)."""
