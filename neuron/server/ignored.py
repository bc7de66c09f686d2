"""Fields a request gave that had no effect: named in the ``x-neuron-ignored`` response header and
the request's log line, never dropped silently. On the OpenAI routes these are the body's fields
that neither vLLM's protocol nor OpenAI's has here (a typo such as ``max_token`` among them);
the Messages API names the fields that mean nothing for the model at hand."""

from __future__ import annotations

import json
import logging
from functools import cache

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from neuron.server.request_id import request_id

IGNORED_HEADER = "x-neuron-ignored"
log = logging.getLogger("neuron.server")
_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])  # the top level's keys; values left unparsed
NAMED, NAME_CHARS = 16, 64  # at most this many names, each cut to this many characters


def unknown_fields(data: bytes, kind: type[msgspec.Struct]) -> list[str]:
    """The body's top-level keys that ``kind`` has no field for, in the body's order. Called after
    the body decoded as ``kind``, so ``data`` is a JSON object."""
    known = _fields(kind)
    return [key for key in _KEYS.decode(data) if key not in known]


@cache
def _fields(kind: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(kind.__struct_encode_fields__)


def say_ignored(request: Request, response: Response, ignored: list[str], model: str) -> Response:
    """``ignored`` in the ``x-neuron-ignored`` header and a log line (nothing when it is empty).
    A name is a client's own text: written as JSON escapes its non-ASCII and control characters
    (a header is Latin-1 without controls), cut to ``NAME_CHARS``, at most ``NAMED`` of them."""
    if ignored:
        names = [json.dumps(name)[1:-1][:NAME_CHARS] for name in ignored[:NAMED]]
        said = ", ".join(names) + (f", and {len(ignored) - NAMED} more" if len(ignored) > NAMED else "")
        response.headers[IGNORED_HEADER] = said
        log.info("%s %s: no effect on %s: %s", request.method, request.url.path, model, said,
                 extra={"request_id": request_id(request)})
    return response
