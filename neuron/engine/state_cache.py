"""The state slots of a model with recurrent layers, and the snapshots that make its prefix cache
work. Plain Python on the leader: the ranks hold the slots, the leader decides what each holds.

A recurrent layer's state cannot be rebuilt from cached K/V, so a cached prefix is only worth
something where the state after it was kept: a **snapshot**, a slot holding a sequence's state
after its first ``position`` tokens. Every slot is one pool: a running sequence holds one, a
snapshot holds one, the rest are free. Snapshots are kept where reuse is likely:

- inside a prompt, every ``interval`` tokens and at its last full block (``prompt_points``): a
  repeated prompt, or a long shared system prompt followed by different questions, restarts
  there. The rank copies the state out in the middle of the step that passes the point.
- at the end of every finished sequence, its own slot, with no copy: the next turn of a chat
  starts with the whole of this one (prompt and answer), so it restarts at the very end. The
  partial block after the last full one stays held with it; the next turn copies it into a
  block of its own (``kv_from``) and writes the rest.

A snapshot a sequence has gone past is **passed** and evicted first (``passed``): one it kept
inside its prompt, once it keeps a deeper one (unless a sequence has restarted from it: a shared
system prompt); and one it started from that is not at a multiple of ``interval`` (an earlier
turn's end, a prompt's last block), once it keeps one past it. A chat's next turn starts at the
end of the last one and keeps its own end, so each conversation holds one snapshot that is not
passed, its latest. A snapshot restarted from at a multiple of ``interval`` (a shared system
prompt's) is kept as recently used as the deepest restart past it (``share``, ``touch_path``).

A snapshot is keyed by the chain hash of the last full KV block before its point (``parent``:
that hash names every token before it, the model and the cache salt) and the tokens after that
block (``tail``, empty at a block boundary). A request finds its longest cached run of full
blocks (``BlockManager.match``), then the deepest snapshot along it. Snapshots are evicted least
recently used first: when a slot is wanted and none is free, and with the KV block they hang on
(their prefix can no longer be matched). A snapshot being restored is pinned until the restoring
sequence's first step is planned (the rank copies it out in that step, before any later step
may reuse the slot). With a host tier, snapshots at block boundaries are told to it as they are
kept and as they are evicted (``on_keep``, ``on_evict``): they go down the tiers (``host_tier.py``);
so do the end-of-answer snapshots (``on_keep_tail``, ``on_evict_tail``), with the partial block
they hang on, both named by ``tail_name``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from .blocks import BlockManager, OutOfBlocks, chain_hash


TAIL = b"tail snapshot"
SHARED = 4096  # names of shared snapshots known (``StateCache.share``)


def tail_name(parent: bytes, tail) -> bytes:
    """What names a snapshot ``tail`` tokens past the block hashed ``parent`` (and the partial
    block of K/V it hangs on) in the tiers below the ranks."""
    return chain_hash(parent, tuple(tail), TAIL)


@dataclass(eq=False)
class Snapshot:
    slot: int
    position: int  # the tokens whose state it holds
    parent: bytes
    tail: tuple[int, ...]
    block: int = -1  # the KV block holding the tail's K/V (held while the snapshot lives), or -1
    pins: int = 0
    used: bool = False  # a sequence has restarted from it
    passed: bool = False  # a sequence went past it (``StateCache.passed``)


class StateCache:
    def __init__(self, num_slots: int, blocks: BlockManager, interval: int = 512, spare: int = 0) -> None:
        self.num_slots = num_slots
        # Slots snapshots leave free while one can be evicted instead: a step's drafts take them
        # (``scratch``), and cached snapshots are not evicted for drafts.
        self.keep_free = spare
        self.blocks = blocks
        self.bs = blocks.block_size
        self.interval = max(interval // self.bs, 1) * self.bs
        self._free: deque[int] = deque(range(num_slots))
        self.running = 0
        self.pending = 0  # slots of snapshots planned in a step whose reply is not in yet
        self._by_key: dict[tuple[bytes, tuple[int, ...]], Snapshot] = {}
        self._lru: OrderedDict[Snapshot, None] = OrderedDict()
        self._tails: dict[bytes, list[Snapshot]] = {}
        self.restored = 0  # sequences that started from a snapshot
        # Told (slot, hash of its block) of each snapshot at a block boundary kept, and of each
        # evicted (before its slot is handed out again): the host tier's copies.
        self.on_keep: list = []
        self.on_evict: list = []
        # told (slot, tail_name, its partial block) of each end-of-answer snapshot kept, and evicted
        self.on_keep_tail: list = []
        self.on_evict_tail: list = []
        self._named: dict[bytes, Snapshot] = {}  # end-of-answer snapshots by tail_name
        self.on_pass: list = []  # told the name of each snapshot ``passed``
        self._passed: OrderedDict[Snapshot, None] = OrderedDict()  # in the order they were passed
        self._shared: OrderedDict[bytes, None] = OrderedDict()  # ``share``d, least recently restarted past first
        self.on_touch: list = []  # told the name of each shared snapshot a restart went past
        blocks.on_evict.append(self._block_evicted)

    @property
    def caching(self) -> bool:
        return self.blocks.cache_key is not None

    @property
    def snapshots(self) -> int:
        return len(self._lru)

    @property
    def used(self) -> int:
        """Slots held by running sequences."""
        return self.running

    @property
    def free_count(self) -> int:
        """Slots a running sequence can get: free ones and those of unpinned snapshots."""
        return len(self._free) + sum(1 for s in self._lru if not s.pins)

    # ----------------------------------------------------------------------------- slots
    def _take(self, last_resort: bool) -> int | None:
        """A free slot beyond those kept for drafts, else an unpinned snapshot's, else (as a
        ``last_resort``) one of those kept."""
        if len(self._free) > self.keep_free:
            return self._free.popleft()
        victim = next((s for s in self._passed if not s.pins), None) \
            or next((s for s in self._lru if not s.pins), None)
        if victim is None:
            return self._free.popleft() if last_resort and self._free else None
        self._drop(victim, free=False)
        return victim.slot

    def allocate(self) -> int:
        """A slot for a running sequence."""
        slot = self._take(True)
        if slot is None:
            raise OutOfBlocks("no state slot is free")
        self.running += 1
        return slot

    def release(self, slots: list[int]) -> None:
        """A running sequence's slot is free again (its state is of no further use)."""
        for slot in slots:
            self.running -= 1
            self._free.append(slot)
        slots.clear()

    @property
    def spare(self) -> int:
        """Free slots a step's drafts can take now (``scratch``)."""
        return len(self._free)

    def scratch(self) -> int | None:
        """A free slot for a state kept only until a step's reply (speculative decoding: the state
        after each draft, one of which may become the sequence's), or None (cached snapshots are
        not evicted for it)."""
        return self._free.popleft() if self._free else None

    def unscratch(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def reserve(self) -> int | None:
        """A slot for a snapshot the next step takes, or None when every slot is in use."""
        if not self.caching:
            return None
        slot = self._take(False)
        if slot is not None:
            self.pending += 1
        return slot

    def abandon(self, slot: int) -> None:
        """A reserved snapshot that will not be kept (its step failed, or its sequence is gone)."""
        self.pending -= 1
        self._free.append(slot)

    # ----------------------------------------------------------------------------- snapshots
    def root(self, key: bytes) -> bytes:
        """The parent of a snapshot inside the first block: the request's cache key itself."""
        return b"root|" + key

    def keep(self, slot: int, position: int, parent: bytes, tail: tuple[int, ...] = (), block: int = -1,
             running: bool = False) -> bool:
        """Slot ``slot`` holds the state after ``position`` tokens whose last full block hashes to
        ``parent`` and which end with ``tail``: keep it (a reserved slot, or with ``running`` a
        finishing sequence's own). ``block``: the KV block of the tail, which the snapshot now
        holds a reference to. False (the slot freed, the block not taken) when an equal snapshot
        is kept already."""
        if running:
            self.running -= 1
        else:
            self.pending -= 1
        key = (parent, tail)
        if key in self._by_key:
            self._free.append(slot)
            return False
        snap = Snapshot(slot, position, parent, tail, block)
        if block >= 0:
            self.blocks.take([block])
        self._by_key[key] = snap
        self._lru[snap] = None
        if tail:
            self._tails.setdefault(parent, []).append(snap)
            if block >= 0:
                name = tail_name(parent, tail)
                self._named[name] = snap
                for tell in self.on_keep_tail:
                    tell(slot, name, block)
        else:
            for tell in self.on_keep:
                tell(slot, parent)
        return True

    def holds(self, slot: int, h: bytes) -> bool:
        """Whether ``slot`` holds the snapshot right after the block hashed ``h``, or the
        end-of-answer one ``tail_name`` names ``h``."""
        snap = self._by_key.get((h, ())) or self._named.get(h)
        return snap is not None and snap.slot == slot

    def find(self, tokens: list[int], limit: int, hashes: list[bytes], key: bytes) -> tuple[int, Snapshot] | None:
        """The deepest snapshot along ``tokens`` (at most ``limit`` of them), whose full blocks
        are the first ``len(hashes)`` (cached; ``hashes``: theirs): (full blocks it uses, it)."""
        bs = self.bs
        for depth in range(len(hashes), -1, -1):
            parent = hashes[depth - 1] if depth else self.root(key)
            best = None
            for snap in self._tails.get(parent, ()):
                end = depth * bs + len(snap.tail)
                if end <= limit and tuple(tokens[depth * bs: end]) == snap.tail and \
                        (best is None or len(snap.tail) > len(best.tail)):
                    best = snap
            if best is None and depth:
                best = self._by_key.get((parent, ()))
            if best is not None:
                self._lru.move_to_end(best)
                return depth, best
        return None

    def pin(self, snap: Snapshot) -> None:
        snap.pins += 1
        snap.used, snap.passed = True, False
        self._passed.pop(snap, None)
        self.restored += 1

    def passed(self, name: bytes, started: bool = False) -> None:
        """A sequence kept a snapshot deeper than the one ``name`` names (the one after the block
        hashed ``name``, or the end-of-answer one ``tail_name`` names so), which it kept itself or,
        with ``started``, started from: that one is evicted before the others, the first passed
        first, here and in the tiers below. One it kept itself stays as it is if a sequence has
        restarted from it (a shared prefix, a branch)."""
        snap = self._by_key.get((name, ())) or self._named.get(name)
        if snap is not None and (started or not snap.used):
            snap.passed = True
            self._passed[snap] = None
        elif not started:
            return
        for tell in self.on_pass:
            tell(name)

    def share(self, name: bytes) -> None:
        """A sequence restarted from the snapshot after the block hashed ``name``, at a multiple
        of ``interval``: a prefix others may share (a system prompt), kept as recently used as
        the deepest restart past it (``touch_path``). The last ``SHARED`` such names are known."""
        self._shared[name] = None
        self._shared.move_to_end(name)
        if len(self._shared) > SHARED:
            self._shared.popitem(last=False)

    def touch_path(self, hashes: list[bytes]) -> None:
        """A sequence restarted past the blocks ``hashes``: the shared snapshots along them were
        just used, here and in the tiers below (a chat that finds its whole history keeps its
        system prompt's snapshot from aging out, as a match keeps the prompt's blocks)."""
        for h in hashes if self._shared else ():
            if h in self._shared:
                self._shared.move_to_end(h)
                snap = self._by_key.get((h, ()))
                if snap is not None:
                    self._lru.move_to_end(snap)
                for tell in self.on_touch:
                    tell(h)

    def is_passed(self, name: bytes) -> bool:
        snap = self._by_key.get((name, ())) or self._named.get(name)
        return snap is not None and snap.passed

    def unpin(self, snap: Snapshot) -> None:
        snap.pins -= 1

    def prompt_points(self, start: int, end: int, prompt: int, floor: int) -> list[int]:
        """Where a chunk over positions ``start..end`` (exclusive) of a sequence whose prompt has
        ``prompt`` tokens takes snapshots: the multiples of ``interval`` and the prompt's last full
        block before its last token, past ``floor`` (where the sequence started from one)."""
        last = (prompt - 1) // self.bs * self.bs
        points = {p for p in range((start // self.interval + 1) * self.interval, end + 1, self.interval)}
        if start < last <= end:
            points.add(last)
        return sorted(p for p in points if p > floor and p <= prompt)

    def _drop(self, snap: Snapshot, free: bool = True) -> None:
        if not snap.tail:
            for tell in self.on_evict:
                tell(snap.slot, snap.parent)
        if snap.tail and snap.block >= 0:
            name = tail_name(snap.parent, snap.tail)
            del self._named[name]
            for tell in self.on_evict_tail:
                tell(snap.slot, name, snap.block)
        del self._by_key[(snap.parent, snap.tail)]
        del self._lru[snap]
        self._passed.pop(snap, None)
        if snap.tail:
            self._tails[snap.parent].remove(snap)
            if not self._tails[snap.parent]:
                del self._tails[snap.parent]
        if snap.block >= 0:
            self.blocks.release([snap.block])
        if free:
            self._free.append(snap.slot)

    def _block_evicted(self, block: int, h: bytes) -> None:
        """The cached block whose hash is ``h`` gave up its prefix: snapshots right after it can
        no longer be matched."""
        for snap in [s for s in self._tails.get(h, ()) if not s.pins]:
            self._drop(snap)
        snap = self._by_key.get((h, ()))
        if snap is not None and not snap.pins:
            self._drop(snap)
