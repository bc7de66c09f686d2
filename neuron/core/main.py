"""``neuron serve`` with ``[server] api_processes > 0``: this process is the engine core (the
Registry, every model's Engine and rank group) and serves no HTTP itself; it binds the port and
starts that many API processes that listen on it (``neuron/server/api_process.py``), which own HTTP and talk
to it over ZeroMQ (``link.py``). SIGTERM drains as in one process: admission stops, running
requests finish up to the deadline, then the API processes are told to leave and the ranks stop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import msgspec

import protocol.api_core as m
from protocol.sockets import ipc_endpoint

from .. import heap
from ..config import Config, ModelEntry
from ..errors import ApiError, LoadError
from ..loader.template_worker import TemplateRenderer
from ..registry import Registry
from ..response_store import ResponseStore
from ..shutdown import BACKSTOP_S, SAME_SIGNAL_S, SHUTDOWN_GRACE_S
from .api_processes import ApiProcesses
from .link import ApiLink
from ..http_port import port_socket

log = logging.getLogger("neuron.core")
BROADCAST_S = 0.5  # how often the API processes hear the models' state (and stats) unasked
LEAVE_S = 5.0  # how long API processes may take to leave once told


class Core:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.templates = TemplateRenderer(cfg.templates, cfg.server.allow_request_chat_template)
        self.registry = Registry(cfg, templates=self.templates)
        self.link = ApiLink(lambda: self.registry.models, self.snapshot, self.registry.ctx,
                            ipc_endpoint(self.registry.runtime, "api"), self.call)
        self.processes = ApiProcesses(cfg, self.link.endpoint, self.link.token, self.link.gone, self.registry.runtime)
        self.starting, self.draining, self.closing = True, False, False
        self.startup_error: str | None = None
        self.responses = ResponseStore(cfg.server.stored_responses)  # /v1/responses of every API process
        self.version = 0
        self.done = asyncio.Event()
        self.exit_code = 0
        self._first = (0, 0.0)  # the first stop signal and when it came

    def snapshot(self) -> m.Models:
        self.version += 1
        r = self.registry
        models = [m.ModelState(h.id, h.status, msgspec.json.encode(h.entry), h.max_len, h.error,
                               msgspec.json.encode(h.describe()), msgspec.json.encode(h.engine.stats()),
                               msgspec.json.encode(h.telemetry())) for h in list(r.models.values())]
        return m.Models(models, self.starting, self.draining, self.startup_error, self.version,
                        msgspec.json.encode(r.cluster.describe()) if r.cluster is not None else b"", self.closing)

    async def call(self, ident: bytes, call: m.Call) -> tuple[int, bytes]:
        if call.what == "refresh":
            frame = self.snapshot()
            self.link.send(ident, frame)
            return 200, str(frame.version).encode()
        if call.what == "load":
            entry = msgspec.json.decode(call.body, type=ModelEntry)
            try:
                handle = await self.registry.load(entry)
            except LoadError as exc:
                raise ApiError(exc.status, exc.code, exc.message, param="model") from None
            await self.link.sync(self.snapshot())
            return 200, msgspec.json.encode(handle.describe())
        body = msgspec.json.decode(call.body)
        if call.what == "response_put":
            self.responses.put(body["id"], body["messages"], body["response"])
            return 200, b"null"
        if call.what == "response_get":
            return 200, msgspec.json.encode(self.responses.get(body))
        if call.what == "unload":
            outcome = await self.registry.unload(body["model"], body["drain_s"])
            await self.link.sync(self.snapshot())
            return 200, msgspec.json.encode(outcome)
        if call.what == "fault":
            return 200, msgspec.json.encode(await self.registry.inject_fault(body["model"], body["rank"], body["kind"]))
        raise ApiError(400, "invalid_request", f"the core answers no call {call.what!r}")

    async def run(self) -> int:
        self.link.start()
        self.processes.start()
        ticker = asyncio.create_task(self._broadcast())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        if hasattr(signal, "SIGHUP"):  # the operator edited the keys file: every API process reads it
            loop.add_signal_handler(signal.SIGHUP, self.processes.forward, signal.SIGHUP)
        startup = asyncio.create_task(self._load_startup_models())
        await self.done.wait()
        startup.cancel()
        ticker.cancel()
        await self._close()
        return self.exit_code

    async def _broadcast(self) -> None:
        while True:
            self.link.broadcast(self.snapshot())
            await asyncio.sleep(BROADCAST_S)

    async def _load_startup_models(self) -> None:
        try:
            for entry in self.cfg.models:
                await self.registry.load(entry)
        except Exception as exc:
            self.startup_error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            log.error("startup model failed to load: %s", self.startup_error)
            self.exit_code = 1
            self.done.set()
            return
        self.starting = False
        await self.link.sync(self.snapshot())
        heap.settle_collector()
        log.info("ready: %s (%d API processes)", ", ".join(self.registry.models), len(self.processes.procs))

    def _on_signal(self, sig: int) -> None:
        if self.draining:
            if sig == self._first[0] and time.monotonic() - self._first[1] < SAME_SIGNAL_S:
                return  # the same signal delivered twice (to the process and its group, or by a wrapper)
            log.warning("second signal (%s): killing the ranks and exiting now", signal.Signals(sig).name)
            self.processes.kill()
            self.registry.kill_all()
            os._exit(1)
        self.draining = True
        self._first = (sig, time.monotonic())
        self.registry.stop_admission()
        self.link.broadcast(self.snapshot())
        asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        timeout = self.cfg.server.drain_timeout_s
        log.info("draining in-flight requests (up to %.0fs)", timeout)
        backstop = threading.Timer(timeout + SHUTDOWN_GRACE_S + LEAVE_S + BACKSTOP_S, os._exit, (0,))
        backstop.daemon = True
        backstop.start()
        if not await self.registry.drain(timeout):
            log.warning("drain deadline passed; ending what is left with an error")
            self.registry.abort_all("the server is shutting down")
            await self.registry.drain(SHUTDOWN_GRACE_S)
        self.done.set()

    async def _close(self) -> None:
        self.closing = True
        self.link.broadcast(self.snapshot())  # the streams write their last events and leave
        await self.processes.stop(LEAVE_S)
        self.link.close()
        await self.registry.shutdown()
        self.templates.close()


async def serve_core(cfg: Config) -> int:
    try:
        held = port_socket(cfg, listening=False)
    except OSError as exc:
        log.error("cannot bind %s:%d: %s", cfg.server.host, cfg.server.port, exc)
        return 1
    try:
        return await Core(cfg).run()
    finally:
        held.close()
