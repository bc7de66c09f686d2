"""A bound on the request bytes being read, parsed and tokenized at once.

A prompt costs far more memory while it is parsed and planned than its body's size (a 4 MB prompt
peaks near 0.5 GB in the tokenizer), so the chat, completion, Responses and tokenize routes hold
their body's size of ``[http] max_inflight_body_bytes`` from when the body has arrived until their
prompt is tokenized; requests past it wait their turn, in arrival order. The share is taken only
once the body is in, so a client that sends its body slowly holds none of it. Bodies of at most
``SMALL_BODY`` bytes (nearly every chat turn) have a lane of their own, so they never queue
behind big ones (twelve 3.5 MB bodies being tokenized made a 100-byte chat wait 40 s), and big
bodies are planned on threads of their own at a lower CPU priority, so that their seconds of
tokenizing do not take the cores from the ranks decoding everyone's streams. When the last share
comes back, the C heap is trimmed, so the memory those prompts took goes back to the system."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from neuron import heap

log = logging.getLogger("neuron.server")
TRIM_AFTER_BYTES = 1 << 20  # trim the heap only after bodies of this much went through
SMALL_BODY = 64 << 10
SMALL_LANE = 4 << 20  # at least; a sixteenth of the budget where that is more
BIG_NICE = 10  # the big lane's threads: CFS gives a thread of nice 0 ~9x the CPU of one at 10

Runner = Callable[..., Awaitable[Any]]


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BIG_NICE)  # this thread only (Linux)
    except (OSError, AttributeError):
        pass


class _Lane:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self.waiters: deque[tuple[int, asyncio.Future]] = deque()

    async def acquire(self, n: int) -> None:
        if not self.waiters and self.free >= n:
            self.free -= n
            return
        future = asyncio.get_running_loop().create_future()
        entry = (n, future)
        self.waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(n)  # granted as the caller left
            elif entry in self.waiters:
                self.waiters.remove(entry)
            raise

    def release(self, n: int) -> None:
        self.free += n
        while self.waiters and self.waiters[0][0] <= self.free:
            m, future = self.waiters.popleft()
            if not future.done():
                self.free -= m
                future.set_result(None)


class BodyBudget:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._big = _Lane(capacity)
        self._small = _Lane(max(SMALL_LANE, capacity // 16))
        self._since_trim = 0
        self._big_threads: ThreadPoolExecutor | None = None

    @asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[Runner]:
        """Hold ``size`` bytes (a body's, already read) of the budget while inside; what it gives
        runs a blocking function off the event loop (``await run(fn, *args)``), on the lane's
        threads."""
        big = size > SMALL_BODY
        lane = self._big if big else self._small
        n = max(1, min(size, lane.capacity))
        await lane.acquire(n)
        try:
            yield self._big_runner() if big else _default_runner
        finally:
            lane.release(n)
            self._after(n)

    def _big_runner(self) -> Runner:
        if self._big_threads is None:
            self._big_threads = ThreadPoolExecutor(8, "big-body", initializer=_lower_priority)
        pool = self._big_threads

        async def run(fn: Callable[..., Any], *args: Any) -> Any:
            return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
        return run

    def _after(self, n: int) -> None:
        self._since_trim += n
        idle = self._big.free == self._big.capacity and self._small.free == self._small.capacity
        if idle and self._since_trim >= TRIM_AFTER_BYTES and heap.AVAILABLE:
            self._since_trim = 0
            asyncio.get_running_loop().run_in_executor(None, heap.trim)


async def _default_runner(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)
