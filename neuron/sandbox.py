"""Work the daemon must be able to abandon, in child processes it can kill.

Some inputs make library code run for ever, eat memory or crash the process: a client's grammar
in llguidance's native code, a chat template's Jinja loops. A thread cannot be stopped, so such
work runs in worker processes (``python -m <module>``): each job has a deadline, past which its
worker is killed; the worker lives under an address-space limit; a worker that grew past
``recycle_rss_bytes`` is replaced after its job, so the memory a job took goes back to the
system; and a worker whose leader is gone leaves by itself.

Frames on a worker's stdin/stdout: a 4-byte big-endian length, then the bytes (msgpack).
"""

from __future__ import annotations

import os
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Callable

_LENGTH = struct.Struct(">I")
PARENT_ENV = "NEURON_SANDBOX_PARENT"
MEMORY_ENV = "NEURON_SANDBOX_MEMORY"


class JobTimeout(Exception):
    """The job ran past its deadline; its worker was killed."""


class JobCrashed(Exception):
    """The worker died or answered nonsense while on the job."""


def read_frame(stream) -> bytes | None:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    return stream.read(_LENGTH.unpack(head)[0])


def write_frame(stream, data: bytes) -> None:
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


# ---------------------------------------------------------------------------------------- worker
def _leave_with_parent(parent: int) -> None:
    """A job can run long (until the leader's deadline kills it): if the leader is gone first,
    nobody will, so the worker ends itself once it has a new parent."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def serve(handle: Callable[[bytes], bytes | None]) -> None:
    """A worker's loop: each frame in goes to ``handle``; what it returns (unless None) goes back."""
    memory = int(os.environ.get(MEMORY_ENV, "0"))
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on stdout
    parent = int(os.environ.get(PARENT_ENV, os.getppid()))  # named: it may be gone already
    threading.Thread(target=_leave_with_parent, args=(parent,), daemon=True).start()
    while (data := read_frame(stdin)) is not None:
        reply = handle(data)
        if reply is not None:
            write_frame(stdout, reply)


# ---------------------------------------------------------------------------------------- leader
class _Worker:
    def __init__(self, module: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
        self.known: set[str] = set()  # preludes already sent

    def run(self, frames: list[bytes], timeout_s: float) -> bytes:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            for frame in frames:
                write_frame(self.proc.stdin, frame)
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
            if not ready:
                raise JobTimeout
            data = read_frame(self.proc.stdout)
        except OSError:
            raise JobCrashed from None
        if data is None:
            raise JobCrashed
        return data

    def rss_bytes(self) -> int:
        try:
            with open(f"/proc/{self.proc.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class WorkerPool:
    """Up to ``workers`` worker processes of ``module``, each on one job at a time. Blocking:
    call ``run`` off the event loop."""

    def __init__(self, module: str, *, workers: int, memory_bytes: int = 0, recycle_rss_bytes: int = 0,
                 env: dict[str, str] | None = None) -> None:
        self.module = module
        self.recycle_rss_bytes = recycle_rss_bytes
        self._env = {**os.environ, **(env or {}), MEMORY_ENV: str(memory_bytes), PARENT_ENV: str(os.getpid())}
        self._slots = threading.BoundedSemaphore(max(1, workers))
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False

    def run(self, job: bytes, timeout_s: float, prelude: tuple[str, bytes] | None = None) -> bytes:
        """The worker's answer to ``job``; ``prelude`` (key, frame): sent first to a worker that
        has not had it (a tokenizer the jobs refer to). JobTimeout, JobCrashed: the worker is gone."""
        with self._slots:
            worker = self._take()
            frames = [job]
            if prelude is not None and prelude[0] not in worker.known:
                frames.insert(0, prelude[1])
                worker.known.add(prelude[0])
            try:
                reply = worker.run(frames, timeout_s)
            except BaseException:
                self._give_back(worker, dead=True)
                raise
            self._give_back(worker)
            return reply

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise JobCrashed
            while self._idle:
                worker = self._idle.pop()
                if worker.proc.poll() is None:
                    self._busy.add(worker)
                    return worker
            worker = _Worker(self.module, self._env)
            self._busy.add(worker)
            return worker

    def _give_back(self, worker: _Worker, dead: bool = False) -> None:
        with self._lock:
            self._busy.discard(worker)
            if dead or self._closed or (self.recycle_rss_bytes and worker.rss_bytes() > self.recycle_rss_bytes):
                worker.kill()
            else:
                self._idle.append(worker)

    def close(self) -> None:
        """Every worker killed, busy ones too: their jobs end with JobCrashed at once."""
        with self._lock:
            self._closed = True
            workers, self._idle = [*self._idle, *self._busy], []
        for worker in workers:
            worker.kill()
