"""The API processes of an engine core: started (each listens on the port in its SO_REUSEPORT
group, ``main.port_socket``: the kernel spreads new connections over them), watched, and started
again when one dies; its requests are aborted in the core by ``on_gone``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import msgspec

from ..config import Config, ServerConfig

log = logging.getLogger("neuron.core")
WATCH_S = 0.2
RESTART_BACKOFF_S = (0.0, 0.5, 2.0, 5.0)  # by deaths within the last minute


def identity(pid: int) -> bytes:
    """An API process's DEALER identity: the core knows who died by its pid."""
    return f"api-{pid}".encode()


# "auto" API processes: none without a GPU (CPU ranks compute on the cores the processes would
# take, and are far from the leader's limit) or below AUTO_API_MIN_CPUS, then one per
# AUTO_API_CPUS_EACH CPUs, at most AUTO_API_MAX (4 held the engine core at 19-25% CPU from 128 to
# 512 streams on a 16-CPU H200 host: scripts/perf-gpu --api-processes 4).
AUTO_API_MIN_CPUS = 8
AUTO_API_CPUS_EACH = 4
AUTO_API_MAX = 4


def api_process_count(server: ServerConfig, cpus: int | None = None, gpus: int | None = None) -> int:
    """How many API processes serve beside the engine core (0: one process does both)."""
    if server.api_processes != "auto":
        return int(server.api_processes)
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if gpus is None:
        from ..devices import gpu_count
        gpus = gpu_count()
    return 0 if not gpus or cpus < AUTO_API_MIN_CPUS else min(AUTO_API_MAX, cpus // AUTO_API_CPUS_EACH)


class ApiProcesses:
    def __init__(self, cfg: Config, endpoint: str, token: str, on_gone: Callable[[bytes], int], runtime: Path) -> None:
        self.cfg, self.endpoint, self.token, self.on_gone = cfg, endpoint, token, on_gone
        self.metrics_dir = runtime / "metrics"  # the API processes' counters (prometheus multiprocess mode)
        self.metrics_dir.mkdir(mode=0o700)
        self.procs: list[subprocess.Popen | None] = [None] * api_process_count(cfg.server)
        self.deaths: list[list[float]] = [[] for _ in self.procs]
        self.closing = False
        self._task: asyncio.Task | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    def start(self) -> None:
        for i in range(len(self.procs)):
            self.procs[i] = self._spawn(i)
        self._task = asyncio.create_task(self._watch(), name="api-processes")

    def _spawn(self, index: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "neuron.server.api_process",
                                 "--core", self.endpoint, "--index", str(index)], stdin=subprocess.PIPE,
                                env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)})
        assert proc.stdin is not None
        # Each names its share of max_principals in /metrics: the series of all of them add up.
        server = dataclasses.replace(self.cfg.server, max_principals=self.cfg.server.max_principals // len(self.procs))
        # Never argv: the config may hold keys, and the token is this run's proof to the core.
        proc.stdin.write(self.token.encode() + b"\n" + msgspec.json.encode(dataclasses.replace(self.cfg, server=server)))
        proc.stdin.close()
        return proc

    async def _watch(self) -> None:
        while not self.closing:
            await asyncio.sleep(WATCH_S)
            for i, proc in enumerate(self.procs):
                if proc is None or proc.poll() is None or self.closing:
                    continue
                aborted = self.on_gone(identity(proc.pid))
                now = time.monotonic()
                self.deaths[i] = [t for t in self.deaths[i] if now - t < 60.0] + [now]
                wait = RESTART_BACKOFF_S[min(len(self.deaths[i]) - 1, len(RESTART_BACKOFF_S) - 1)]
                log.error("API process %d (pid %d) exited with %s; %d request(s) of it aborted; starting it again%s",
                          i, proc.pid, proc.returncode, aborted, f" in {wait:.1f}s" if wait else "")
                self.procs[i] = None
                asyncio.get_running_loop().call_later(wait, self._respawn, i)

    def _respawn(self, index: int) -> None:
        if not self.closing and self.procs[index] is None:
            self.procs[index] = self._spawn(index)

    def forward(self, sig: int) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    async def stop(self, timeout: float) -> None:
        """They were told to leave (``Models.closing``): wait for them, then kill what is left."""
        self.closing = True
        if self._task is not None:
            self._task.cancel()
        deadline = time.monotonic() + timeout
        while any(p is not None and p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        self.closing = True
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
