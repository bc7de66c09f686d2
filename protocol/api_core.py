"""The frames between an API process and the engine core (``[server] api_processes``).

An API process owns HTTP, templates, tokenization, detokenization, stop strings and SSE; the
core owns the models (scheduler, allocator, rank groups). A request goes in as ``Submit``, keyed
by a number its API process chose; what it draws comes back in one ``Outputs`` frame per core
turn for each API process, every sequence's tokens of that turn in it. The API process says
``Abort`` when its client left and ``Stop`` when a stop string ended the text. ``Call`` asks
the core for something an admin route needs (its answer is a JSON body); ``Models`` tells every
API process which models the core serves and how they stand, after each change."""

from __future__ import annotations

from typing import Union

import msgspec

from .messages import Sampling


class ApiFrame(msgspec.Struct, tag_field="op", array_like=True, gc=False, frozen=True):
    pass


class Image(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """An image of a prompt: its ``tokens`` image-pad tokens from ``offset`` on."""

    key: bytes  # content hash
    data: bytes  # the encoded file
    grid: tuple[int, int, int]  # its patches (t, h, w)
    tokens: int
    offset: int = -1


class EngineRequest(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One sequence as the API side hands it to an engine, in this process or over the wire:
    what the scheduler needs, and nothing of its text (detokenizer, stop strings and events stay
    with the API side's output state). Its principal's fair-share terms come with it."""

    request_id: str
    prompt: list[int]
    sampling: Sampling
    max_tokens: int
    stop_token_ids: list[int]
    principal: str = ""
    weight: float = 1.0
    max_running: int = 0
    max_waiting: int = 0
    priority: int = 0
    cache_salt: bytes = b""
    images: list[Image] = []


class Submit(ApiFrame, tag="submit"):
    key: int
    model: str
    request: EngineRequest
    # A token constraint runs in the API process: ``constrained`` says there is one, ``mask`` is
    # what it allows first (None: anything), and after each token a ``Masks`` frame the next.
    constrained: bool = False
    mask: bytes | None = None


class Abort(ApiFrame, tag="abort"):
    keys: list[int]


class Stop(ApiFrame, tag="stop"):
    """A stop string ended these requests' text: the core ends them without another word."""

    keys: list[int]


class Masks(ApiFrame, tag="masks"):
    """Constrained requests' next allowed tokens (a bitmask over the vocabulary, or None), one
    per token the core drew for them: the core samples none of them again before it is in."""

    keys: list[int]
    masks: list[bytes | None]


class Call(ApiFrame, tag="call"):
    """An admin route's question: ``what`` names it, ``body`` is its JSON."""

    id: int
    what: str
    body: bytes = b""


class Hello(ApiFrame, tag="hello"):
    """An API process is up; the core answers with the models' state. ``token``: the one the core
    gave it on stdin for this run; a peer without it is not heard."""

    pid: int
    token: str = ""


class Synced(ApiFrame, tag="synced"):
    """The API process applied ``Models`` of this version."""

    version: int


class Token(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A drawn token. ``end``: 0 the request goes on, 1 the core ends it with this token (its
    length), 2 the token is one of its stop ids (its text is not shown)."""

    key: int
    token: int
    logprobs: list[tuple[int, float]] | None = None
    end: int = 0


class Admitted(msgspec.Struct, array_like=True, gc=False, frozen=True):
    key: int
    cached_tokens: int = 0


class Refused(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """The request never started: an ``ApiError``'s fields."""

    key: int
    status: int
    code: str
    message: str
    retry_after: int | None = None


class Finished(msgspec.Struct, array_like=True, gc=False, frozen=True):
    key: int
    reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    error_kind: str | None = None
    cached_tokens: int = 0
    host_tokens: int = 0  # of cached_tokens, those the prefix cache's host tier held
    disk_tokens: int = 0  # ... of host_tokens, those read back from its disk tier
    preemptions: int = 0  # times it gave its blocks up to running sequences and was computed again


class Outputs(ApiFrame, tag="outputs"):
    """A core turn's news for one API process, in the order it happened."""

    admitted: list[Admitted] = []
    tokens: list[Token] = []
    finished: list[Finished] = []
    refused: list[Refused] = []


class Answer(ApiFrame, tag="answer"):
    """A ``Call``'s answer: an HTTP status and a JSON body."""

    id: int
    status: int
    body: bytes


class ModelState(msgspec.Struct, frozen=True):
    id: str
    status: str
    entry: bytes  # the ModelEntry as JSON
    max_len: int
    error: str | None = None
    described: bytes = b""  # GET /models' entry, as JSON
    stats: bytes = b""  # the EngineStats as JSON
    telemetry: bytes = b"[]"  # each rank's device, as JSON


class Models(ApiFrame, tag="models"):
    models: list[ModelState]
    starting: bool = True
    draining: bool = False
    startup_error: str | None = None
    version: int = 0  # counts the frames: a later one supersedes
    cluster: bytes = b""  # the group of hosts (/health's "cluster"), as JSON; empty on one host
    closing: bool = False  # the core drained: finish writing and exit


ToCore = Union[Submit, Abort, Stop, Masks, Call, Hello, Synced]
ToApi = Union[Outputs, Answer, Models]

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_to_api = msgspec.msgpack.Decoder(ToApi)
encode = _encoder.encode
decode_to_core = _to_core.decode
decode_to_api = _to_api.decode
