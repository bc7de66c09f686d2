"""A request's drawn tokens as text events: the output side of the engine's boundary.

The engine core decides which tokens a request draws and when it ends by token (a stop token
id, ``max_tokens``, the context's end); it hands each drawn id here with its logprobs and
whether it is the request's last. This side detokenizes, holds back text that could begin a
stop string, puts the text events on the request's queue, and says when a stop string ended
the text: the core then finishes the request. Today it runs in the leader's event loop, called
by the core in step; across an API-process split it is where the client is, fed the core's ids,
and its stop goes back to the core as a message (issue 49)."""

from __future__ import annotations

from .request import GenRequest, TokenEvent


def token_out(req: GenRequest, token: int, logprobs: list[tuple[int, float]] | None, last: bool) -> bool:
    """Emit the text ``token`` adds; True where a stop string ended the text with it (``req``
    is then done: the core finishes it as stopped). ``last``: the core ends the request with this
    token, so everything held back goes out with it."""
    text, hit = req.stop_matcher.push(req.detokenizer.push(token))
    if not hit and last:
        text += req.stop_matcher.push(req.detokenizer.flush())[0] + req.stop_matcher.flush()
    _emit(req, text, [token], logprobs)
    return hit


def stop_token_out(req: GenRequest, token: int, logprobs: list[tuple[int, float]] | None) -> None:
    """``token`` is one of the request's stop token ids, which ends it: its text is not shown,
    what was held back (a stop string's possible start) is."""
    _emit(req, req.stop_matcher.flush(), [token], logprobs)


def _emit(req: GenRequest, text: str, ids: list[int], logprobs) -> None:
    req.events.put_nowait(TokenEvent(text, ids, [logprobs] if logprobs else None))
