"""A bound on the request bytes being read, parsed and tokenized at once.

A prompt costs far more memory while it is parsed and planned than its body's size (a 4 MB prompt
peaks near 0.5 GB in the tokenizer), so the chat, completion, Responses and tokenize routes hold
their body's size of ``[http] max_inflight_body_bytes`` from when the body has arrived until their
prompt is tokenized; requests past it wait their turn, in arrival order. The share is taken only
once the body is in, so a client that sends its body slowly holds none of it. When the last
share comes back, the C heap is trimmed, so the memory those prompts took goes back to the
system."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator

log = logging.getLogger("neuron.server")
TRIM_AFTER_BYTES = 1 << 20  # trim the heap only after bodies of this much went through


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim with
        return None


_TRIM = _malloc_trim()


class BodyBudget:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()
        self._since_trim = 0

    @asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        """Hold ``size`` bytes (a body's, already read) of the budget while inside."""
        n = max(1, min(size, self.capacity))
        await self._acquire(n)
        try:
            yield
        finally:
            self._release(n)

    async def _acquire(self, n: int) -> None:
        if not self._waiters and self.free >= n:
            self.free -= n
            return
        future = asyncio.get_running_loop().create_future()
        entry = (n, future)
        self._waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release(n)  # granted as the caller left
            elif entry in self._waiters:
                self._waiters.remove(entry)
            raise

    def _release(self, n: int) -> None:
        self.free += n
        self._since_trim += n
        while self._waiters and self._waiters[0][0] <= self.free:
            m, future = self._waiters.popleft()
            if not future.done():
                self.free -= m
                future.set_result(None)
        if self.free == self.capacity and self._since_trim >= TRIM_AFTER_BYTES and _TRIM is not None:
            self._since_trim = 0
            asyncio.get_running_loop().run_in_executor(None, _TRIM, 0)
