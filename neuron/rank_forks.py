"""Starting rank processes: a CPU rank forked from a warm zygote (``neuron/rank/zygote.py``, torch
imported once per leader) where Linux offers pidfds, else each its own ``python -m neuron.rank``
(GPU ranks too, for now). Either way the caller gets a process with ``pid``, ``returncode``,
``wait()`` and ``send_signal()``. The zygote is started with the daemon (``warm``) so that its
import overlaps the daemon's own start; if it dies, its ranks die with it (each reported as
killed) and the next rank starts a new one."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger("neuron.group")


class ForkedRank:
    """A rank forked by the zygote: its exit comes as the zygote's report."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        """As asyncio's: nothing once it has exited, also when the zygote reaped it and its
        report is still on the way."""
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set_result(code)


RankProc = ForkedRank | asyncio.subprocess.Process


def _start_zygote() -> tuple[subprocess.Popen, int, int]:
    """The zygote process, and the leader's ends of its two pipes (orders, reports)."""
    orders_r, orders = os.pipe()
    reports, reports_w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "neuron.rank.zygote", str(orders_r), str(reports_w),
                             str(os.getpid())], pass_fds=(orders_r, reports_w), stdin=subprocess.DEVNULL)
    os.close(orders_r)
    os.close(reports_w)
    os.set_blocking(reports, False)
    return proc, orders, reports


class Zygote:
    def __init__(self) -> None:
        global _early
        started, _early = _early, None
        if started is not None and started[0].poll() is not None:  # it died before the loop ran
            os.close(started[1])
            os.close(started[2])
            started = None
        self.proc, self.orders, self.reports = started or _start_zygote()
        self.ranks: dict[int, ForkedRank] = {}
        self.forked: asyncio.Queue[int] = asyncio.Queue()
        self.buf = b""
        self.alive = True
        asyncio.get_running_loop().add_reader(self.reports, self._read)

    def _read(self) -> None:
        try:
            chunk = os.read(self.reports, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self._died()
            return
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            msg = json.loads(line)
            if "pid" in msg:
                self.forked.put_nowait(msg["pid"])
            elif (rank := self.ranks.pop(msg["exit"], None)) is not None:
                rank.exited(msg["code"])

    def _died(self) -> None:
        self.alive = False
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.reports)
        os.close(self.reports)
        os.close(self.orders)
        self.proc.wait()
        log.warning("the rank zygote (pid %d) exited with code %s: its %d rank(s) die with it",
                    self.proc.pid, self.proc.returncode, len(self.ranks))
        for pid, rank in self.ranks.items():  # PR_SET_PDEATHSIG: each is being killed, if not dead
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # gone already
                rank.exited(-signal.SIGKILL)
                continue

            def gone(fd: int = fd, rank: ForkedRank = rank) -> None:
                loop.remove_reader(fd)
                os.close(fd)
                rank.exited(-signal.SIGKILL)

            loop.add_reader(fd, gone)
        self.ranks.clear()
        self.forked.put_nowait(-1)  # a fork waited for will not come

    async def fork(self, args: list[str], env: dict[str, str]) -> ForkedRank | None:
        """A rank forked with ``args`` and ``env``; None if the zygote is gone."""
        try:
            os.write(self.orders, json.dumps({"args": args, "env": env}).encode() + b"\n")
        except OSError:
            return None
        pid = await self.forked.get()
        if pid < 0:
            return None
        rank = self.ranks[pid] = ForkedRank(pid)
        return rank

    def release(self) -> None:
        """Let it go (its loop has closed): it exits at the end of its orders."""
        if self.alive:
            self.alive = False
            os.close(self.orders)
            os.close(self.reports)


# One zygote per event loop (a leader has one; a test process may run several loops in turn: the
# zygote of a loop that has closed is let go, and exits at the end of its orders).
_zygotes: dict[asyncio.AbstractEventLoop, tuple[Zygote, asyncio.Lock]] = {}


def forks_available() -> bool:
    """Linux with pidfds the zygote may open (a container's seccomp profile may refuse them)."""
    global _pidfds
    if os.environ.get("NEURON_RANK_FORKS", "1") == "0" or not hasattr(os, "pidfd_open"):
        return False
    if _pidfds is None:
        try:
            os.close(os.pidfd_open(os.getpid()))
            _pidfds = True
        except OSError as exc:
            log.info("ranks start as their own python processes: no pidfds here (%s)", exc)
            _pidfds = False
    return _pidfds


_pidfds: bool | None = None
_early: tuple[subprocess.Popen, int, int] | None = None  # started before the daemon's loop ran


def prestart() -> None:
    """Start the zygote now, before the daemon's own imports, so that its import of torch runs
    beside them; the first ``warm`` takes it."""
    global _early
    if _early is None and forks_available():
        _early = _start_zygote()


def warm() -> tuple[Zygote, asyncio.Lock] | None:
    """The running loop's zygote, started now if it is not running (so that its import overlaps
    the caller's own start); None where ranks cannot be forked."""
    if not forks_available():
        return None
    loop = asyncio.get_running_loop()
    for done in [other for other in _zygotes if other.is_closed()]:
        _zygotes.pop(done)[0].release()
    held = _zygotes.get(loop)
    if held is None or not held[0].alive:
        held = _zygotes[loop] = (Zygote(), held[1] if held else asyncio.Lock())
    return held


async def spawn_rank(args: list[str], env: dict[str, str], device: str) -> RankProc:
    """A rank process running ``python -m neuron.rank ARGS`` in ``env``: forked where its
    ``device`` is the CPU (a GPU rank starts as its own python until forks are proven there).
    A caller cancelled meanwhile (an unload cancelling a load) leaves no rank behind: the start
    runs to its end, so that the zygote's next pid goes to the next order, and what it started
    is killed."""
    start = asyncio.ensure_future(_start(args, env, device))
    try:
        return await asyncio.shield(start)
    except asyncio.CancelledError:
        start.add_done_callback(_kill_started)
        raise


def _kill_started(start: asyncio.Future) -> None:
    if not start.cancelled() and start.exception() is None:
        try:
            start.result().kill()
        except ProcessLookupError:
            pass


async def _start(args: list[str], env: dict[str, str], device: str) -> RankProc:
    held = warm() if device == "cpu" else None
    if held is not None:
        async with held[1]:  # one order and its pid at a time
            rank = await warm()[0].fork(args, env)
        if rank is not None:
            return rank
        log.warning("the rank zygote is gone: rank started by a new python process")
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "neuron.rank", *args, env=env,
                                                stdin=asyncio.subprocess.DEVNULL)
