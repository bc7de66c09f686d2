"""The HTTP server of a process that serves the API (the daemon's one, or an API process): uvicorn
with our limits below the routes, the planning threads, and the drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from neuron.config import Config
from neuron.shutdown import BACKSTOP_S, SAME_SIGNAL_S, SHUTDOWN_GRACE_S

from neuron.server.http_limits import limited_protocol

log = logging.getLogger("neuron")
LEADER_THREADS = 64


class NeuronServer(uvicorn.Server):
    """uvicorn, with SIGTERM (or SIGINT) meaning: stop admitting (503), let in-flight requests
    finish up to the drain deadline, end what is left with an error event, stop the ranks and
    exit 0. A second signal exits at once, and a backstop does the same if the shutdown itself
    ever stalls."""

    def __init__(self, config: uvicorn.Config, app_state) -> None:
        super().__init__(config)
        self.app_state = app_state
        self.exit_code = 0
        self._drain: asyncio.Task | None = None
        self._first_signal, self._first_at = 0, 0.0

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain is not None:
            if sig == self._first_signal and time.monotonic() - self._first_at < SAME_SIGNAL_S:
                return  # the same signal delivered twice (to the process and its group, or by a wrapper)
            self._exit_now(f"second signal ({signal.Signals(sig).name})", 1)
        self._first_signal, self._first_at = sig, time.monotonic()
        self.app_state.draining = True
        self.app_state.engine_client.stop_admission()
        loop = asyncio.get_event_loop()
        self._drain = loop.create_task(self._drain_then_exit())
        timeout = self.app_state.cfg.server.drain_timeout_s
        backstop = threading.Timer(timeout + SHUTDOWN_GRACE_S + BACKSTOP_S, self._exit_now,
                                   ("the shutdown did not end in time", 0))
        backstop.daemon = True
        backstop.start()

    def _exit_now(self, why: str, code: int) -> None:
        log.warning("%s: killing the ranks and exiting now", why)
        self.app_state.engine_client.kill_all()  # the grammar workers leave by themselves with the leader
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(code)

    async def _drain_then_exit(self) -> None:
        client = self.app_state.engine_client
        timeout = self.app_state.cfg.server.drain_timeout_s
        log.info("draining in-flight requests (up to %.0fs)", timeout)
        if not await client.drain(timeout):
            log.warning("drain deadline passed; ending what is left with an error")
            client.abort_all("the server is shutting down")
            # The streams write their last event and [DONE]; the queued get their 503.
            await client.drain(SHUTDOWN_GRACE_S)
        self.should_exit = True

    def fail_startup(self, message: str) -> None:
        self.exit_code = 1
        self.should_exit = True


def planning_threads() -> None:
    """Prompts are planned on threads that mostly wait (on a template or grammar worker, or in a
    tokenizer outside the GIL): enough of them that a few slow requests hold no one else up."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(LEADER_THREADS, thread_name_prefix="leader"))


def uvicorn_config(app, cfg: Config) -> uvicorn.Config:
    # log_config=None: uvicorn's own lines go through our handler (text or JSON) like the rest.
    return uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level=cfg.server.log_level,
                          log_config=None, lifespan="on", timeout_graceful_shutdown=SHUTDOWN_GRACE_S, access_log=False,
                          http=limited_protocol(cfg.http), timeout_keep_alive=cfg.http.keep_alive_timeout_s)
