"""A bound on the request bytes being read, parsed and tokenized at once.

A prompt costs far more memory while it is parsed and planned than its body's size (a 4 MB prompt
peaks near 0.5 GB in the tokenizer), so the chat, completion, Responses and tokenize routes hold
their body's size of ``[http] max_inflight_body_bytes`` from when the body has arrived until their
prompt is tokenized; requests past it wait their turn, in arrival order. The share is taken only
once the body is in, so a client that sends its body slowly holds none of it. Bodies of at most
``SMALL_BODY`` bytes (nearly every chat turn) have a lane of their own, so they never queue
behind big ones (twelve 3.5 MB bodies being tokenized made a 100-byte chat wait 40 s). When the
last share comes back, the C heap is trimmed, so the memory those prompts took goes back to the
system."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator

from neuron import heap

log = logging.getLogger("neuron.server")
TRIM_AFTER_BYTES = 1 << 20  # trim the heap only after bodies of this much went through
SMALL_BODY = 64 << 10
SMALL_LANE = 4 << 20  # at least; a sixteenth of the budget where that is more


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

    @asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        """Hold ``size`` bytes (a body's, already read) of the budget while inside."""
        lane = self._small if size <= SMALL_BODY else self._big
        n = max(1, min(size, lane.capacity))
        await lane.acquire(n)
        try:
            yield
        finally:
            lane.release(n)
            self._after(n)

    def _after(self, n: int) -> None:
        self._since_trim += n
        idle = self._big.free == self._big.capacity and self._small.free == self._small.capacity
        if idle and self._since_trim >= TRIM_AFTER_BYTES and heap.AVAILABLE:
            self._since_trim = 0
            asyncio.get_running_loop().run_in_executor(None, heap.trim)
