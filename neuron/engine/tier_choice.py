"""Whether a prefix found only in the disk tier is worth reading, or faster computed again: from
what the reads and the prompt steps have been seen to take. Reading ``n`` blocks costs ``n /
read rate``, computing them ``n * block_size / prompt rate``: the choice is the same for every
``n``, so it is one switch, kept by two moving averages. Until both have been seen, reads go on.
While computing is faster, reads still go out for ``PROBE_WINDOW_S`` every ``PROBE_S`` seconds, so
that a disk that has become faster (or a busier device) is noticed."""

from __future__ import annotations

import time

PROBE_S = 30.0
PROBE_WINDOW_S = 1.0
SAMPLE_TOKENS = 256  # a prompt step's rate counts only with this many prompt tokens in it


class ReadOrCompute:
    def __init__(self, block_size: int, clock=time.monotonic) -> None:
        self.block_size = block_size
        self.clock = clock
        self.read_rate: float | None = None  # blocks a second
        self.prompt_rate: float | None = None  # prompt tokens a second
        self._sent: dict[bytes, float] = {}
        self._probed = float("-inf")
        self.skipped = 0  # lookups that left the disk tier's blocks to be computed again

    def sent(self, hashes: list[bytes]) -> None:
        now = self.clock()
        for h in hashes:
            self._sent.setdefault(h, now)

    def landed(self, hashes: list[bytes]) -> None:
        """Reads reported done (or lost) together: their rate, from the first of them sent."""
        starts = [self._sent.pop(h) for h in hashes if h in self._sent]
        if starts:
            rate = len(starts) / max(self.clock() - min(starts), 1e-4)
            self.read_rate = rate if self.read_rate is None else 0.8 * self.read_rate + 0.2 * rate

    def computed(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` prompt tokens in ``seconds`` (its decodes' time included)."""
        if tokens >= SAMPLE_TOKENS and seconds > 0:
            rate = tokens / seconds
            self.prompt_rate = rate if self.prompt_rate is None else 0.8 * self.prompt_rate + 0.2 * rate

    def worth_reading(self) -> bool:
        if self.read_rate is None or self.prompt_rate is None or \
                self.read_rate * self.block_size >= self.prompt_rate:
            return True
        now = self.clock()
        if now - self._probed < PROBE_WINDOW_S:  # a probe's lookups (a request looks more than once)
            return True
        if now - self._probed >= PROBE_S:
            self._probed = now
            return True
        self.skipped += 1
        return False
