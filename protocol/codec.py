"""One codec for every frame: msgpack bytes <-> tagged Structs, with failures as values."""

from __future__ import annotations

from typing import Any

import msgspec

from .messages import REPLY_TYPES, REQUEST_TYPES, Frame, Reply, Request

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_raw_decoder = msgspec.msgpack.Decoder()

REQUEST_OPS = frozenset(t.__struct_config__.tag for t in REQUEST_TYPES)
REPLY_OPS = frozenset(t.__struct_config__.tag for t in REPLY_TYPES)


class FrameError(Exception):
    """A frame that could not be decoded; ``kind`` is ``unknown_op`` or ``bad_request``.

    ``id`` and ``epoch`` are recovered from the raw frame where possible so that the peer can
    still be answered with an error that names the request.
    """

    def __init__(self, kind: str, message: str, id: int = 0, epoch: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.id = id
        self.epoch = epoch


def encode(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode_request(data: bytes) -> Request:
    return _decode(data, _request_decoder, REQUEST_OPS)


def decode_reply(data: bytes) -> Reply:
    return _decode(data, _reply_decoder, REPLY_OPS)


def decode_any(data: bytes) -> Request | Reply:
    """For observers (the tap): a frame of either direction."""
    try:
        return decode_request(data)
    except FrameError:
        return decode_reply(data)


def _decode(data: bytes, decoder: msgspec.msgpack.Decoder, ops: frozenset[str]) -> Any:
    try:
        return decoder.decode(data)
    # msgspec also raises UnicodeDecodeError (bad UTF-8 in a str) and RecursionError (deep nesting)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError) as exc:
        raise _explain(data, ops, exc) from None


def _explain(data: bytes, ops: frozenset[str], exc: Exception) -> FrameError:
    try:
        raw = _raw_decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return FrameError("bad_request", f"malformed frame: {type(exc).__name__}: {str(exc)[:200]}")
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        return FrameError("bad_request", "malformed frame: expected [op, id, epoch, ...]")
    op = raw[0]
    id_ = raw[1] if len(raw) > 1 and type(raw[1]) is int else 0
    epoch = raw[2] if len(raw) > 2 and type(raw[2]) is int else 0
    if op not in ops:
        return FrameError("unknown_op", f"unknown op {op[:64]!r}", id_, epoch)
    return FrameError("bad_request", f"bad {op!r} frame: {exc}", id_, epoch)
