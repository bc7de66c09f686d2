"""The engine core's side of its API processes (``[server] api_processes``).

One ROUTER; each API process is a DEALER peer named by its identity. A ``Submit`` becomes a
request of the model's Engine whose ``sink`` is its API process's box: what the engine emits
for it during a turn (admission, drawn tokens, its end) goes out as one ``Outputs`` frame per API
process when the turn yields. An API process that goes away takes only its own requests: they
are aborted and their KV blocks freed at the next step. A peer is heard only once it has said
Hello with this run's token, which the core gave each API process on its stdin: another program
of the same user on the socket is dropped, and a load never waits for it (nor more than
``SYNC_S`` for anyone)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from typing import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

import protocol.api_core as m
from protocol.engine_client import FinishEvent

from ..engine.late_masks import NOT_YET
from ..engine.request import GenRequest
from ..errors import ApiError

log = logging.getLogger("neuron.core")
Caller = Callable[[bytes, m.Call], Awaitable[tuple[int, bytes]]]
SYNC_S = 5.0  # how long a load or unload waits for the API processes to know of it
STRANGERS_LOGGED = 64


class Box:
    """One API process's news of the current turn, sent as one ``Outputs`` frame."""

    __slots__ = ("link", "ident", "admitted", "tokens", "finished", "refused", "scheduled", "requests")

    def __init__(self, link: ApiLink, ident: bytes) -> None:
        self.link, self.ident = link, ident
        self.admitted: list[m.Admitted] = []
        self.tokens: list[m.Token] = []
        self.finished: list[m.Finished] = []
        self.refused: list[m.Refused] = []
        self.scheduled = False
        self.requests: dict[int, tuple[GenRequest, object]] = {}  # key: (request, its engine)

    def due(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.scheduled = False
        frame = m.Outputs(self.admitted, self.tokens, self.finished, self.refused)
        self.admitted, self.tokens, self.finished, self.refused = [], [], [], []
        self.link.send(self.ident, frame)


class Sink:
    """A request's way out of the engine to the API process its client is on."""

    __slots__ = ("box", "key")

    def __init__(self, box: Box, key: int) -> None:
        self.box, self.key = box, key

    def token(self, token: int, logprobs: list[tuple[int, float]] | None, end: int) -> bool:
        self.box.tokens.append(m.Token(self.key, token, logprobs, end))
        self.box.due()
        return False  # a stop string is the API process's to find: it says Stop

    def finish(self, event: FinishEvent) -> None:
        box = self.box
        e = event
        box.finished.append(m.Finished(self.key, e.reason, e.prompt_tokens, e.completion_tokens, e.error, e.error_kind,
                                       e.cached_tokens, e.host_tokens, e.disk_tokens, e.preemptions))
        box.requests.pop(self.key, None)
        box.due()

    def admitted(self, req: GenRequest, fut: asyncio.Future) -> None:
        box = self.box
        exc = None if fut.cancelled() else fut.exception()
        if exc is None:
            box.admitted.append(m.Admitted(self.key, req.cached_tokens))
        else:
            box.requests.pop(self.key, None)
            box.refused.append(refusal(self.key, exc))
        box.due()


class RemoteConstraint:
    """A token constraint that runs in the request's API process. It sends the mask of output
    token 0 with the request, and the mask of token i + 1 once it has token i: the masks come in
    order (``mask_at``). Without late masks the request waits (``waiting``: the scheduler samples
    it no more) until the mask of its next token is in."""

    __slots__ = ("masks", "arrivals", "accepted")

    def __init__(self, mask: bytes | None) -> None:
        self.masks: dict[int, bytes | None] = {0: mask}
        self.arrivals = 1
        self.accepted = 0

    def mask_at(self, index: int):
        return self.masks.get(index, NOT_YET)

    def allowed(self) -> bytes | None:
        return self.masks.get(self.accepted)

    @property
    def waiting(self) -> bool:
        return self.accepted not in self.masks

    def accept(self, token: int) -> None:
        self.masks.pop(self.accepted, None)
        self.accepted += 1

    def arrived(self, mask: bytes | None) -> None:
        self.masks[self.arrivals] = mask
        self.arrivals += 1


def refusal(key: int, exc: BaseException) -> m.Refused:
    if isinstance(exc, ApiError):
        return m.Refused(key, exc.status, exc.code, exc.message, exc.retry_after)
    return m.Refused(key, 500, "internal_error", f"{type(exc).__name__}: {exc}")


class ApiLink:
    def __init__(self, models: Callable[[], dict], snapshot: Callable[[], m.Models], ctx: zmq.asyncio.Context,
                 endpoint: str, caller: Caller) -> None:
        self.token = secrets.token_hex(16)  # this run's: the API processes get it on stdin
        self.strangers: set[bytes] = set()  # peers heard without it (logged once each, up to STRANGERS_LOGGED)
        self.models = models  # model id -> ModelHandle, the registry's
        self.snapshot = snapshot  # the models' state as API processes see it
        self.caller = caller
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # a token is never dropped for a slow reader
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(endpoint)
        self.endpoint = endpoint
        self.boxes: dict[bytes, Box] = {}
        self.synced: dict[bytes, int] = {}  # the models' version each API process last applied
        self.dropped = 0
        self._task: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._receive(), name="api-link")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sock.close(0)

    def send(self, ident: bytes, frame: m.ApiFrame) -> None:
        # No wait: with no high-water mark pyzmq sends at once. Through its asyncio socket, not a
        # shadow: a send on the raw socket can swallow the edge that wakes our receiver.
        self.sock.send_multipart([ident, m.encode(frame)]).add_done_callback(_retrieved)

    def broadcast(self, frame: m.ApiFrame) -> None:
        for ident in list(self.boxes):
            self.send(ident, frame)

    def gone(self, ident: bytes) -> int:
        """An API process died: abort what it had running. Returns how many."""
        box = self.boxes.pop(ident, None)
        self.synced.pop(ident, None)
        if box is None:
            return 0
        for req, engine in box.requests.values():
            engine.abort(req)
        return len(box.requests)

    async def _receive(self) -> None:
        while True:
            parts = await self.sock.recv_multipart()
            if len(parts) != 2:
                self.dropped += 1
                continue
            ident, data = parts
            try:
                msg = m.decode_to_core(data)
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError) as exc:
                self.dropped += 1
                log.warning("undecodable frame from API process %r: %s", ident, exc)
                continue
            box = self.boxes.get(ident)
            if box is None:
                if not (isinstance(msg, m.Hello) and hmac.compare_digest(msg.token.encode(), self.token.encode())):
                    self._stranger(ident)
                    continue
                box = self.boxes[ident] = Box(self, ident)
            try:
                self._handle(box, msg)
            except Exception as exc:  # a bug here must refuse one request, never stop the link
                log.exception("API process %r: its %s frame failed", ident, type(msg).__name__)
                if isinstance(msg, m.Submit):
                    box.requests.pop(msg.key, None)
                    box.refused.append(refusal(msg.key, exc))
                    box.due()

    def _stranger(self, ident: bytes) -> None:
        """A frame from a peer that never said Hello with this run's token: dropped."""
        self.dropped += 1
        if ident not in self.strangers and len(self.strangers) < STRANGERS_LOGGED:
            self.strangers.add(ident)
            log.warning("a peer on the core's socket (%r) has not shown this run's token: its frames are dropped",
                        ident[:64])

    def _handle(self, box: Box, msg: m.ApiFrame) -> None:
        ident = box.ident
        if isinstance(msg, m.Submit):
            self._submit(box, msg)
        elif isinstance(msg, (m.Abort, m.Stop)):
            reason = "stop" if isinstance(msg, m.Stop) else "abort"
            for key in msg.keys:
                held = box.requests.get(key)
                if held is not None:
                    held[1].abort(held[0], reason)
        elif isinstance(msg, m.Masks):
            by_engine: dict = {}
            for key, mask in zip(msg.keys, msg.masks):
                held = box.requests.get(key)
                if held is not None and isinstance(held[0].constraint, RemoteConstraint):
                    held[0].constraint.arrived(mask)
                    by_engine.setdefault(held[1], []).append(held[0])
            for engine, reqs in by_engine.items():  # one frame to the ranks per engine
                engine.masks_arrived(reqs)
        elif isinstance(msg, m.Call):
            task = asyncio.create_task(self._answer(ident, msg))
            self._calls.add(task)  # held until it answers
            task.add_done_callback(self._calls.discard)
        elif isinstance(msg, m.Synced):
            self.synced[ident] = msg.version
        elif isinstance(msg, m.Hello):
            log.info("API process %d is up", msg.pid)
            self.send(ident, self.snapshot())

    def _submit(self, box: Box, s: m.Submit) -> None:
        handle = self.models().get(s.model)
        if handle is None:
            box.refused.append(m.Refused(s.key, 404, "model_not_found", f"model {s.model!r} is not loaded"))
            box.due()
            return
        sink = Sink(box, s.key)
        req = GenRequest.of(s.request, sink, RemoteConstraint(s.mask) if s.constrained else None)
        try:
            handle.engine.submit(req)
        except ApiError as exc:
            box.refused.append(refusal(s.key, exc))
            box.due()
            return
        box.requests[s.key] = (req, handle.engine)
        req.admitted.add_done_callback(lambda fut: sink.admitted(req, fut))

    async def _answer(self, ident: bytes, call: m.Call) -> None:
        try:
            status, body = await self.caller(ident, call)
        except ApiError as exc:
            status, body = exc.status, error_body(exc)
        except Exception as exc:
            log.exception("API call %r failed", call.what)
            status, body = 500, error_body(ApiError(500, "internal_error", f"{type(exc).__name__}: {exc}"))
        self.send(ident, m.Answer(call.id, status, body))

    async def sync(self, frame: m.Models, timeout: float = SYNC_S) -> None:
        """Send every API process the models' new state and wait until each has applied it (a
        model a load just answered for is then known to whichever process the next request hits)."""
        self.broadcast(frame)
        deadline = asyncio.get_running_loop().time() + timeout
        while any(self.synced.get(i, -1) < frame.version for i in self.boxes):
            if asyncio.get_running_loop().time() > deadline:
                late = [i.decode(errors="replace") for i in self.boxes if self.synced.get(i, -1) < frame.version]
                log.warning("API processes %s did not apply the models' state %d in %.0fs: going on without them",
                            ", ".join(late), frame.version, timeout)
                return
            await asyncio.sleep(0.01)


def error_body(exc: ApiError) -> bytes:
    return msgspec.json.encode({"status": exc.status, "code": exc.code, "message": exc.message, "param": exc.param,
                                "retry_after": exc.retry_after})


def _retrieved(fut: asyncio.Future) -> None:
    # A process that went away (ROUTER_MANDATORY): its supervisor notices and calls gone().
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("cannot send to an API process: %s", fut.exception())
