"""Server-sent events' data lines. A line ends only at CR or LF in the SSE format, but many
clients split a stream with ``str.splitlines`` (httpx's ``aiter_lines`` among them), which also
breaks at U+0085, U+2028 and U+2029; JSON allows them raw, and a model's text may hold them. So
they go out escaped, as JSON's ``\\uXXXX``: the same JSON, on one line for every reader."""

from __future__ import annotations

import json
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode
_RAW = ("\u0085", "\u2028", "\u2029")
_RAW_BYTES = [(ch.encode(), f"\\u{ord(ch):04x}".encode()) for ch in _RAW]


def json_line(payload: Any) -> bytes:
    """``payload`` as compact JSON without any character a line splitter breaks at."""
    out = _encode(payload)
    for raw, escaped in _RAW_BYTES:
        if raw in out:
            out = out.replace(raw, escaped)
    return out


def json_text(payload: Any) -> str:
    """The same as text, for writers of str (key order and non-ASCII kept, as json.dumps)."""
    out = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    for ch in _RAW:
        out = out.replace(ch, f"\\u{ord(ch):04x}")
    return out
