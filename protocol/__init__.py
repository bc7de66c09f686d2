"""The wire protocol shared by the leader, the rank processes and the tap."""

from .codec import FrameError, decode_any, decode_reply, decode_request, encode
from .messages import *  # noqa: F403
from .messages import MAX_DRAFTS, REPLY_TYPES, REQUEST_TYPES, Frame, ModelConfig, Reply, Request, Sampling, StepSeq

__all__ = [
    "FrameError",
    "decode_any",
    "decode_reply",
    "decode_request",
    "encode",
    "Frame",
    "ModelConfig",
    "Reply",
    "Request",
    "Sampling",
    "StepSeq",
    "MAX_DRAFTS",
    "REPLY_TYPES",
    "REQUEST_TYPES",
]
