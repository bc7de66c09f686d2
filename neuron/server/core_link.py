"""An API process's side of the engine core (``[server] api_processes``).

A request is planned here as in one process (template, tokens, sampling, an ``OutputState``
with its detokenizer and stop strings) and its ``EngineRequest`` submitted to the core under a
key of ours. The core's ``Outputs`` frames carry each turn's admissions, drawn ids and ends; the
ids go through the output state here (``neuron/server/output/``), onto its event queue, to the
route that streams them. A stop string found here ends the request at once and
tells the core to drop it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

import protocol.api_core as m

from neuron.errors import ApiError
from neuron.server.output.state import OutputState
from protocol.engine_client import FinishEvent

log = logging.getLogger("neuron.server")
OnFinish = Callable[[str, OutputState, FinishEvent], None]


class CoreLink:
    def __init__(self, endpoint: str, token: str, on_models: Callable[[m.Models], Awaitable[None]],
                 on_finish: OnFinish | None = None) -> None:
        self.token = token  # this run's, from the core: it hears us only with it
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
            self.sock.setsockopt(opt, value)
        self.sock.setsockopt(zmq.IDENTITY, f"api-{os.getpid()}".encode())  # as the core's supervisor names us
        self.sock.connect(endpoint)
        self.on_models = on_models
        self.on_finish = on_finish
        self.requests: dict[int, tuple[OutputState, str]] = {}  # key: (request, model id)
        self.key_of: dict[OutputState, int] = {}
        self._keys = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._aborts: list[int] = []
        self._stops: list[int] = []
        self._masks: tuple[list[int], list[bytes | None]] = ([], [])
        self._scheduled = False
        self._models: asyncio.Queue[m.Models] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    @property
    def started(self) -> bool:
        return bool(self._tasks)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive(), name="core-link"),
                       asyncio.create_task(self._apply_models(), name="core-models")]
        self.send(m.Hello(os.getpid(), self.token))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.sock.close(0)
        self.ctx.term()

    def send(self, frame: m.ApiFrame) -> None:
        # No wait: with no high-water mark pyzmq sends at once. Through its asyncio socket, not a
        # shadow: a send on the raw socket can swallow the edge that wakes our receiver.
        self.sock.send(m.encode(frame)).add_done_callback(_retrieved)

    # ----------------------------------------------------------------------------- requests
    def submit(self, model_id: str, req: OutputState) -> None:
        """Hand ``req``'s request to the core. Encoded before it is kept: a request that cannot
        be sent (an error, a 500) leaves nothing behind here."""
        key = next(self._keys)
        constrained = req.constraint is not None
        data = m.encode(m.Submit(key, model_id, req.wire, constrained,
                                 req.constraint.allowed() if constrained else None))
        self.requests[key] = (req, model_id)
        self.key_of[req] = key
        self.sock.send(data).add_done_callback(_retrieved)

    def abort(self, req: OutputState) -> None:
        key = self.key_of.get(req)
        if key is not None and not req.finished:
            self._aborts.append(key)
            self._due()

    def _due(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._aborts:
            self.send(m.Abort(self._aborts))
            self._aborts = []
        if self._stops:
            self.send(m.Stop(self._stops))
            self._stops = []
        if self._masks[0]:
            self.send(m.Masks(*self._masks))
            self._masks = ([], [])

    async def call(self, what: str, body: bytes = b"", timeout: float | None = None) -> bytes:
        """Ask the core; its answer's body, or the ApiError it answered with."""
        call_id = next(self._keys)
        fut = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            self.send(m.Call(call_id, what, body))
            answer: m.Answer = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if answer.status != 200:
            err = msgspec.json.decode(answer.body)
            raise ApiError(answer.status, err["code"], err["message"], param=err.get("param"),
                           retry_after=err.get("retry_after"))
        return answer.body

    # ----------------------------------------------------------------------------- the core's news
    async def _receive(self) -> None:
        while True:
            data = await self.sock.recv()
            try:
                frame = m.decode_to_api(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("undecodable frame from the engine core: %s", exc)
                continue
            try:
                self._deliver(frame)
            except Exception:  # one bad frame must not stop the streams of every other request
                log.exception("the engine core's %s frame could not be delivered", type(frame).__name__)

    def _deliver(self, frame: m.ApiFrame) -> None:
        if isinstance(frame, m.Outputs):
            self._outputs(frame)
        elif isinstance(frame, m.Answer):
            fut = self._calls.get(frame.id)
            if fut is not None and not fut.done():
                fut.set_result(frame)
        elif isinstance(frame, m.Models):
            self._models.put_nowait(frame)

    async def _apply_models(self) -> None:
        """Models frames in order, apart from the receiver: learning a model reads its tokenizer."""
        while True:
            frame = await self._models.get()
            while not self._models.empty():  # only the newest state matters
                frame = self._models.get_nowait()
            try:
                await self.on_models(frame)
            except Exception:
                log.exception("applying the models' state %d failed", frame.version)
            self.send(m.Synced(frame.version))

    def _outputs(self, o: m.Outputs) -> None:
        requests = self.requests
        for a in o.admitted:
            held = requests.get(a.key)
            if held is not None:
                held[0].admit(a.cached_tokens)
        # Constrained requests' next masks first, out to the core at once: a step waits for them.
        # The output stage (text, stop strings, events) after.
        keys, masks, early, seen = [], [], [False] * len(o.tokens), set()
        for i, t in enumerate(o.tokens):
            held = requests.get(t.key)
            if held is not None and held[0].constraint is not None and not t.end and t.key not in seen:
                held[0].constraint.accept(t.token)
                seen.add(t.key)
                keys.append(t.key)
                masks.append(held[0].constraint.allowed())
                early[i] = True
        if keys:  # after any still batched: each request's masks must reach the core in order
            (before, earlier), self._masks = self._masks, ([], [])
            self.send(m.Masks(before + keys, earlier + masks))
        for i, t in enumerate(o.tokens):
            held = requests.get(t.key)
            if held is not None:
                self._token(t, *held, accepted=early[i])
        for f in o.finished:
            held = requests.get(f.key)
            if held is not None:
                self._finish(f.key, held, FinishEvent(f.reason, f.prompt_tokens, f.completion_tokens, f.error,
                                                      f.error_kind, f.cached_tokens, f.host_tokens,
                                                      f.disk_tokens, f.preemptions))
        for r in o.refused:
            held = requests.pop(r.key, None)
            if held is not None:
                self.key_of.pop(held[0], None)
                held[0].admit(0, ApiError(r.status, r.code, r.message, retry_after=r.retry_after))

    def _token(self, t: m.Token, req: OutputState, model_id: str, accepted: bool = False) -> None:
        if req.constraint is not None and not accepted:
            req.constraint.accept(t.token)
        if req.token(t.token, t.logprobs, t.end):  # a stop string: ours to end, the core's to drop
            self._stops.append(t.key)
            self._due()
            self._finish(t.key, (req, model_id), FinishEvent("stop", len(req.prompt), len(req.output),
                                                             cached_tokens=req.cached_tokens))
        elif req.constraint is not None and not t.end and not accepted:  # the core draws its next token with this
            self._masks[0].append(t.key)
            self._masks[1].append(req.constraint.allowed())
            self._due()

    def _finish(self, key: int, held: tuple[OutputState, str], ev: FinishEvent) -> None:
        req, model_id = held
        del self.requests[key]
        self.key_of.pop(req, None)
        req.finish(ev)
        if self.on_finish is not None:
            self.on_finish(model_id, req, ev)

    def fail_all(self, reason: str) -> None:
        """The core is gone: every request ends with an error."""
        for key, held in list(self.requests.items()):
            req = held[0]
            if not req.admitted.done():
                del self.requests[key]
                self.key_of.pop(req, None)
                req.admit(0, ApiError(503, "model_unavailable", reason, retry_after=5))
            else:
                self._finish(key, held, FinishEvent("abort", len(req.prompt), len(req.output), reason,
                                                    "model_unavailable", req.cached_tokens))


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("cannot send to the engine core: %s", fut.exception())
