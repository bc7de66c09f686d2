"""The host tier of the prefix cache: which host slot holds which evicted block. Plain Python on the
leader, as ``blocks`` is: the ranks hold the slots (``runner/host_tier.py``), one block of their
own share of the K/V each, and move blocks as the steps say (``Step.offload``, ``Step.restore``).

A block the rank's cache caches (``BlockManager.on_register``) is copied into a slot soon after,
a few a step (``take_moves``), while it stays in the rank's cache too: when the rank's cache
evicts it (``BlockManager.on_evict``) the tier holds it already, and eviction costs no copy. One
evicted before its turn is offloaded then, in the step that hands its block out again (the list
of those waiting holds at most as many as the rank's cache has blocks: the oldest go first). A
prompt whose cached prefix runs on past the rank's cache finds the rest here (``extend``): each such block gets a new block
of the rank's cache and a restore, and is cached there again once the step that restored it has
answered (``restored``). Slots are evicted least recently used first; a slot with a restore
still to be sent is pinned (an offload must not overwrite it before the restore has read it).

A step that fails may have left some of its moves undone: the tier then forgets everything
(``reset``), and restores that were out with it cache nothing (their ``epoch`` is old).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .blocks import BlockManager, chain_hash


@dataclass
class Moves:
    """What one step moves between the rank's cache and the host tier."""

    offload: list[tuple[int, int]] = field(default_factory=list)  # (block, slot)
    restore: list[tuple[int, int]] = field(default_factory=list)  # (slot, block)
    # (request, its run, table entry, hash) of each block restored: cached once the step answers
    cached: list[tuple] = field(default_factory=list)
    epoch: int = 0


class HostTier:
    def __init__(self, slots: int, blocks: BlockManager) -> None:
        self.slots = slots
        self.blocks = blocks
        self._fresh = 0
        self._free: deque[int] = deque()
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}
        self._offload: list[tuple[int, int]] = []
        # cached blocks to copy in, when a step has room
        self._early: deque[tuple[int, bytes]] = deque(maxlen=blocks.num_blocks)
        self.epoch = 0
        self.offloaded = 0  # blocks copied into the tier
        self.restored = 0  # ... and back
        self.hits = 0  # prompt tokens found here
        blocks.on_evict.append(self._evicted)
        blocks.on_register.append(lambda block, h: self._early.append((block, h)))

    @property
    def used(self) -> int:
        return len(self._hash_of)

    def _evicted(self, block: int, h: bytes) -> None:
        slot = self._by_hash.get(h)
        if slot is not None:  # the tier has it already (copied early, or it came back from here)
            self._lru.move_to_end(slot)
            return
        self._copy(block, h)

    def _copy(self, block: int, h: bytes) -> bool:
        slot = self._slot()
        if slot is None:
            return False
        self._by_hash[h], self._hash_of[slot] = slot, h
        self._lru[slot] = None
        self._offload.append((block, slot))
        self.offloaded += 1
        return True

    def _copy_early(self, room: int) -> None:
        """Up to ``room`` cached blocks into the tier ahead of their eviction, oldest first."""
        while room > 0 and self._early:
            block, h = self._early.popleft()
            if h in self._by_hash or not self.blocks.holds(block, h):
                continue  # in the tier already, or gone from the rank's cache (offloaded then)
            if not self._copy(block, h):
                return
            room -= 1

    def _slot(self) -> int | None:
        if self._fresh < self.slots:
            self._fresh += 1
            return self._fresh - 1
        if self._free:
            return self._free.popleft()
        victim = next((s for s in self._lru if s not in self._pins), None)
        if victim is not None:
            del self._lru[victim]
            del self._by_hash[self._hash_of.pop(victim)]
        return victim

    def extend(self, tokens: list[int], limit: int, hashes: list[bytes], key: bytes) -> list[tuple[int, bytes]]:
        """The (slot, hash) of each block that continues the cached prefix ``hashes`` of
        ``tokens`` (at most ``limit`` tokens in all) from the tier."""
        bs = self.blocks.block_size
        found: list[tuple[int, bytes]] = []
        parent = hashes[-1] if hashes else b""
        for i in range(len(hashes), min(limit, len(tokens)) // bs):
            h = chain_hash(parent, tokens[i * bs: (i + 1) * bs], key)
            slot = self._by_hash.get(h)
            if slot is None:
                break
            self._lru.move_to_end(slot)
            found.append((slot, h))
            parent = h
        return found

    def pin(self, slots: list[int]) -> None:
        for s in slots:
            self._pins[s] = self._pins.get(s, 0) + 1

    def unpin(self, slots: list[int]) -> None:
        for s in slots:
            left = self._pins[s] - 1
            if left:
                self._pins[s] = left
            else:
                del self._pins[s]

    def take_moves(self, restores: list[tuple[int, int]], early: int = 0) -> Moves:
        """The next step's moves: every offload due and up to ``early`` cached blocks copied
        ahead of their eviction, then ``restores`` ((slot, block))."""
        self._copy_early(early)
        moves = Moves(self._offload, restores, epoch=self.epoch)
        self._offload = []
        self.restored += len(restores)
        return moves

    def reset(self) -> None:
        """Forget every slot (a step that failed may have left its moves undone)."""
        self._fresh = 0
        self._free.clear()
        self._by_hash.clear()
        self._hash_of.clear()
        self._lru.clear()
        self._pins.clear()
        self._offload = []
        self._early.clear()
        self.epoch += 1
