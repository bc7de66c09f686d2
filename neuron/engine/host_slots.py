"""The host tier's slots by name (``host_tier.py`` decides what goes in them): which slot holds
which block or snapshot piece, the order they leave in, and which may not leave yet.

A slot is fresh (never used), free, or named by a hash. Named slots leave least recently used
first, except that those ``demote`` was told of go before any other, the first demoted first. A
pinned slot (a restore of it still to be sent, a disk read into it not landed) never leaves."""

from __future__ import annotations

from collections import OrderedDict, deque


class SlotPool:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.fresh = 0  # slots handed out so far: the rest have never been used
        self.free: deque[int] = deque()
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.demoted: OrderedDict[int, None] = OrderedDict()
        self.pins: dict[int, int] = {}

    @property
    def used(self) -> int:
        return len(self.hash_of)

    def name(self, slot: int, h: bytes) -> None:
        """``slot`` holds ``h`` now, the most recently used."""
        self.by_hash[h], self.hash_of[slot], self.lru[slot] = slot, h, None

    def touch(self, slot: int) -> None:
        """``slot`` was used: it goes last, even if it was demoted."""
        self.lru.move_to_end(slot)
        self.demoted.pop(slot, None)

    def demote(self, slots) -> None:
        self.demoted.update((s, None) for s in slots)

    def unused(self) -> int | None:
        """A slot that holds nothing: a fresh one, or a freed one."""
        if self.fresh < self.slots:
            self.fresh += 1
            return self.fresh - 1
        return self.free.popleft() if self.free else None

    def evict(self, busy: set[int]) -> tuple[int, bytes] | None:
        """The slot to reuse (not pinned, not in ``busy``) and the hash it held, now forgotten."""
        victim = next((s for s in self.demoted if s not in self.pins and s not in busy), None)
        if victim is None:
            victim = next((s for s in self.lru if s not in self.pins and s not in busy), None)
        if victim is None:
            return None
        h = self.hash_of[victim]
        self.forget([victim], free=False)
        return victim, h

    def forget(self, slots: list[int], free: bool = True) -> None:
        """What ``slots`` hold is gone; with ``free`` they are free now."""
        for s in slots:
            del self.by_hash[self.hash_of.pop(s)], self.lru[s]
            self.demoted.pop(s, None)
        if free:
            self.free.extend(slots)

    def pin(self, slots: list[int]) -> None:
        self.pins.update((s, self.pins.get(s, 0) + 1) for s in slots)

    def unpin(self, slots: list[int]) -> None:
        for s in slots:
            self.pins[s] -= 1
            if not self.pins[s]:
                del self.pins[s]

    def reset(self) -> None:
        """Every slot fresh again."""
        self.fresh = 0
        for kept in (self.free, self.by_hash, self.hash_of, self.lru, self.demoted, self.pins):
            kept.clear()
