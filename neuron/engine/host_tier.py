"""The host tier of the prefix cache: which host slot holds which evicted block. Plain Python on the
leader, as ``blocks`` is: the ranks hold the slots (``runner/host_tier.py``), one block of their
own share of the K/V each, and move them as the steps say; ``host_slots.SlotPool`` keeps their
names and the order they leave in. docs/architecture.md#the-host-tier:

- A cached block is copied into a slot a few a step (``take_moves``) while the rank's cache keeps
  it, so its eviction costs no copy; one evicted before its turn is offloaded with the step that
  hands its block out again, or (``held_by``) with the step that first writes it.
- A prompt whose cached prefix runs on past the rank's cache finds the rest here (``extend``),
  restored into new blocks and cached there again once that step has answered. Slots go least
  recently used first; one with a restore still to be sent is pinned. A failed step makes the
  tier forget everything (``reset``, ``epoch``).
- Below it the disk tier (``use_disk``) keeps what the host tier holds, written through
  (``Step.spill``); a block found only there gets a slot and a read (``Step.fetch``), restored
  once the read's news is in (``news``), where reading is faster than computing (``tier_choice``);
  a failed read takes it out of both tiers and its requests start again.
- A model with recurrent state (``use_states``) keeps its snapshots here too, each as ``pieces``
  slots named by ``state_keys``: copied in early (``note_state``) or as the ranks evict them
  (``offload_state``), found by ``state_at``, taken by ``take_state``; one its own sequence has
  passed (``StateCache.passed``) goes before the rest (``demote``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from contextlib import contextmanager

from .blocks import BlockManager
from .host_slots import SlotPool
from .tier_choice import ReadOrCompute
from .tier_moves import Moves, state_keys


class HostTier:
    def __init__(self, slots: int, blocks: BlockManager) -> None:
        self.slots = slots
        self.blocks = blocks
        self.pool = SlotPool(slots)
        self._offload: list[tuple[int, int]] = []
        # block -> (slot, the request holding it, its run): offloads that wait for the block's first write
        self._deferred: dict[int, tuple[int, object, int]] = {}
        self._holder: tuple[object, int] | None = None
        # cached blocks to copy in, when a step has room
        self._early: deque[tuple[int, bytes]] = deque(maxlen=blocks.num_blocks)
        self.epoch = 0
        self.offloaded = self.restored = self.hits = 0  # blocks copied into the tier, and back; prompt tokens found
        self.disk: OrderedDict[bytes, None] | None = None  # the disk tier's blocks, least recently used first
        self.disk_blocks = 0
        self.fetching: dict[int, bytes] = {}  # slot -> the block a rank reads into it from disk
        self._spill, self._fetch, self._drop = [], [], []  # (slot, hash), (hash, slot), hashes: the next step's
        self._written_next: list[tuple[int, bytes]] = []  # offloaded by the last step: to disk next
        self.disk_hits = self.disk_written = self.disk_read = 0  # prompt tokens found there; blocks
        # A model with recurrent state (``use_states``): slots a snapshot takes, pieces copied in
        self.pieces, self._state_offload, self._early_states, self._state_live = 0, [], deque(), None
        self.states_offloaded = self.states_restored = 0  # snapshots
        blocks.on_evict.append(self._evicted)
        blocks.on_register.append(lambda block, h: self._early.append((block, h)))

    @property
    def used(self) -> int:
        return self.pool.used

    def counts(self) -> tuple[int, ...]:
        skipped = self.choice.skipped if self.disk is not None else 0
        return (self.hits, self.offloaded, self.restored, self.disk_hits, self.disk_written, self.disk_read,
                self.states_offloaded, self.states_restored, skipped)

    def use_states(self, pieces: int, live, snapshots: int, passed=lambda h: False) -> None:
        """Snapshots of ``pieces`` slots each; ``live(slot, h)``: whether the ranks' slot still holds
        the one after block ``h``; at most ``snapshots`` wait to be copied early; ``passed(h)``:
        whether it is one to evict first (``demote``)."""
        self.pieces, self._state_live, self._passed = pieces, live, passed
        self._early_states = deque(maxlen=max(1, snapshots))

    def demote(self, h: bytes) -> None:
        """The snapshot after ``h`` goes before the rest, the first demoted first (``StateCache.passed``)."""
        self.pool.demote(self.pool.by_hash[k] for k in state_keys(h, self.pieces) if k in self.pool.by_hash)

    def touch_state(self, h: bytes) -> None:
        """The snapshot after ``h`` was just used (``StateCache.touch_path``): it leaves last."""
        for k in state_keys(h, self.pieces):
            if k in self.pool.by_hash:
                self.pool.touch(self.pool.by_hash[k])

    def note_state(self, slot: int, h: bytes, block: int = -1) -> None:
        """The ranks keep a snapshot after block ``h`` in ``slot`` (or, with the partial ``block``
        it hangs on, one named ``h`` by ``tail_name``): copied in when a step has room."""
        if self.pieces:
            self._early_states.append((slot, h, block))

    def offload_state(self, slot: int, h: bytes) -> bool:
        """The ranks' snapshot after block ``h`` in state ``slot`` is copied in by the next step,
        unless the tier holds it; False if the tier has no room for all its pieces (it takes none)."""
        if not self.pieces:
            return False
        keys = state_keys(h, self.pieces)
        held = [self.pool.by_hash[k] for k in keys if k in self.pool.by_hash]
        if len(held) == len(keys):
            for s in held:
                self.pool.lru.move_to_end(s)
            return True
        new = []
        self.pool.pin(held)
        for j, k in enumerate(keys):
            if k in self.pool.by_hash:
                continue
            got = self._slot()
            if got is None:
                break
            self.pool.name(got, k)
            self.pool.pin([got])
            new.append((slot, j, got))
        self.pool.unpin(held + [s for _, _, s in new])
        if len(held) + len(new) < len(keys):
            self.pool.forget([s for _, _, s in new])
            return False
        self._state_offload += new
        self.offloaded += len(new)
        self.states_offloaded += 1
        if self._passed(h):
            self.demote(h)
        return True

    def state_at(self, h: bytes) -> bool:
        """Whether the tier (or the disk below it) holds every piece of the snapshot after ``h``."""
        first = state_keys(h, 1)[0]  # most blocks have no snapshot: name the rest only where the first is
        return bool(self.pieces) and self.has(first) and all(self.has(k) for k in state_keys(h, self.pieces)[1:])

    def has(self, h: bytes) -> bool:
        """Whether the tier holds ``h`` (a block or a piece), or the disk below it, to be read."""
        return h in self.pool.by_hash or self._on_disk(h)

    def _on_disk(self, h: bytes) -> bool:
        """Whether ``h`` is on disk, to be read (not where computing it again is faster)."""
        return self.disk is not None and h in self.disk and self.choice.worth_reading()

    def take_state(self, h: bytes) -> list[tuple[int, bytes]]:
        """The (slot, name) of each piece of the snapshot after ``h`` (those on disk get a slot
        and a read), or [] where a piece cannot be had."""
        found: list[tuple[int, bytes]] = []
        for k in state_keys(h, self.pieces):
            slot = self.take(k, [s for s, _ in found])
            if slot is None:
                return []
            found.append((slot, k))
        return found

    def use_disk(self, blocks: int, hashes: list[bytes]) -> None:
        """The ranks' disk tier holds ``blocks`` files at most, ``hashes`` already (oldest first)."""
        self.disk_blocks = blocks
        self.choice = ReadOrCompute(self.blocks.block_size)
        self.disk = OrderedDict.fromkeys(hashes[-blocks:] if blocks else [])
        self._drop += hashes[:-blocks] if blocks else hashes

    def _to_disk(self, slot: int, h: bytes) -> None:
        """The block ``h`` in ``slot`` is written to disk by the next step, unless it is there."""
        if self.disk is None:
            return
        if h in self.disk:
            self.disk.move_to_end(h)
            return
        reading = set(self.fetching.values())
        while len(self.disk) >= self.disk_blocks:
            old = next((x for x in self.disk if x not in reading), None)
            if old is None:
                return
            del self.disk[old]
            unsent = next((i for i, (_, x) in enumerate(self._spill) if x == old), None)
            if unsent is None:
                self._drop.append(old)
            else:  # its write has not gone out yet: it never will
                del self._spill[unsent]
        self.disk[h] = None
        self._spill.append((slot, h))
        self.disk_written += 1

    def news(self, fetched: list[bytes], lost: list[bytes]) -> list[int]:
        """The sampling rank's news of the disk tier; the slots whose read failed (their blocks
        gone from both tiers: ``free`` them once no request waits for them)."""
        self.choice.landed(fetched)
        for h in fetched:
            slot = self.pool.by_hash.get(h)
            if slot is not None and self.fetching.get(slot) == h:
                del self.fetching[slot]
                self.pool.unpin([slot])
                self.disk_read += 1
        failed = []
        for h in lost:
            if self.disk is not None:
                self.disk.pop(h, None)
            slot = self.pool.by_hash.get(h)
            if slot is not None and self.fetching.get(slot) == h:
                del self.fetching[slot]
                self.pool.unpin([slot])
                self.pool.forget([slot], free=False)
                failed.append(slot)
        return failed

    def _evicted(self, block: int, h: bytes) -> None:
        slot = self.pool.by_hash.get(h)
        if slot is not None:  # the tier has it already (copied early, or it came back from here)
            self.pool.lru.move_to_end(slot)
            return
        self.copy_block(block, h)

    def copy_block(self, block: int, h: bytes) -> bool:
        slot = self._slot()
        if slot is None:
            return False
        self.pool.name(slot, h)
        if self._holder is not None:
            self._deferred[block] = (slot, *self._holder)
            self.pool.pin([slot])
        else:
            self._offload.append((block, slot))
        self.offloaded += 1
        return True

    @contextmanager
    def held_by(self, req):
        """Blocks evicted meanwhile go to ``req`` (a request with a ``run`` and ``blocks``), which
        writes them only in the steps that ``take_moves`` is told of: their offloads wait."""
        self._holder = (req, req.run)
        try:
            yield
        finally:
            self._holder = None

    def deferred(self, block: int) -> bool:
        return block in self._deferred

    @property
    def deferred_any(self) -> bool:
        return bool(self._deferred)

    def _due(self, restores: list[tuple[int, int]], written: set[int], everything: bool) -> None:
        """The deferred offloads the next step must carry (see the module's docstring)."""
        if not self._deferred:
            return
        into, sources = {b for _, b in restores}, {s for s, _ in restores}
        tables: dict[int, set[int]] = {}
        for block, (slot, req, run) in list(self._deferred.items()):
            if not everything and block not in written and block not in into and slot not in sources:
                held = tables.get(id(req))
                if held is None:
                    held = tables[id(req)] = set(req.blocks) if req.run == run and req.slot >= 0 else set()
                if block in held:
                    continue
            del self._deferred[block]
            self._offload.append((block, slot))
            self.pool.unpin([slot])

    def _copy_early(self, room: int, idle: bool) -> None:
        """Up to ``room`` cached blocks into the tier ahead of their eviction, oldest first, then
        the ranks' state snapshots (in a step with no decodes, ``idle``, one even where its pieces
        outnumber the room)."""
        while room > 0 and self._early:
            block, h = self._early.popleft()
            if h in self.pool.by_hash or not self.blocks.holds(block, h):
                continue  # in the tier already, or gone from the rank's cache (offloaded then)
            if not self.copy_block(block, h):  # no slot free to take now: a later step copies it
                self._early.appendleft((block, h))
                return
            room -= 1
        while self._early_states and (room >= self.pieces or idle and room > 0):
            slot, h, block = self._early_states.popleft()
            if self._state_live(slot, h) and not (self.state_at(h) and (block < 0 or h in self.pool.by_hash)):
                if not self.offload_state(slot, h) or block >= 0 and h not in self.pool.by_hash and \
                        not self.copy_block(block, h):
                    return
                room -= self.pieces + (block >= 0)

    def _slot(self) -> int | None:
        slot = self.pool.unused()
        if slot is not None:
            return slot
        # its block goes in with the next step: not yet there
        evicted = self.pool.evict({s for _, s in self._offload} | {s for _, _, s in self._state_offload})
        if evicted is None:
            return None
        self._to_disk(*evicted)
        return evicted[0]

    def reach(self, chain: list[bytes], start: int) -> list[bytes]:
        """The hashes of ``chain`` from its ``start``-th on that the tier (or the disk below it)
        holds, one after another."""
        found: list[bytes] = []
        for h in chain[start:]:
            if not self.has(h):
                break
            found.append(h)
        return found

    def extend(self, chain: list[bytes], start: int, keep: list[int] = ()) -> list[tuple[int, bytes]]:
        """The (slot, hash) of each block of ``chain`` from its ``start``-th on (those after the
        cached prefix) from the tier; a slot read from disk for one never takes ``keep``'s."""
        found: list[tuple[int, bytes]] = []
        self.pool.pin(keep)  # and each slot found, while the rest are found: none is evicted for another
        for h in self.reach(chain, start):
            reads = len(self._fetch)
            slot = self.take(h, ())
            if slot is None:
                break
            self.pool.pin([slot])
            self.disk_hits += self.blocks.block_size * (len(self._fetch) - reads)
            found.append((slot, h))
        self.pool.unpin([*keep, *(s for s, _ in found)])
        return found

    def take(self, h: bytes, keep: list[int]) -> int | None:
        """The slot holding ``h`` (a block, or a snapshot's piece): in the tier, or one it is read
        into from disk (no slot of ``keep`` is evicted for it); None where neither can be."""
        slot = self.pool.by_hash.get(h)
        if slot is None and self.disk is not None and h in self.disk:
            self.disk.move_to_end(h)
            self.pool.pin(keep)
            slot = self._slot()
            self.pool.unpin(keep)
            if slot is not None and h not in self.disk:  # writing the slot's block out pushed h off
                self.pool.free.append(slot)
                slot = None
            if slot is None:
                return None
            self.pool.name(slot, h)
            self.fetching[slot] = h
            self.pool.pin([slot])  # until the read is in
            self._fetch.append((h, slot))
        if slot is not None:
            self.pool.touch(slot)
        return slot

    def take_moves(self, restores: list[tuple[int, int]], room: int = 0, written: frozenset[int] | set[int] = frozenset(),
                   everything: bool = False, state_restores: list[tuple[int, int, int]] = ()) -> Moves:
        """The next step's moves: every offload due (the step writes ``written`` blocks;
        ``everything``: all deferred ones too) and cached blocks copied ahead of their eviction
        while the moves number fewer than ``room``, then ``restores`` ((slot, block)) and
        ``state_restores`` ((slot, state slot, piece)) ."""
        for slot, h in self._written_next:  # offloaded by the step before: on the host now
            if self.pool.hash_of.get(slot) == h:
                self._to_disk(slot, h)
        self._due(restores, written, everything)
        self._copy_early(room - len(self._offload) - len(self._state_offload) - len(restores) - len(state_restores),
                         everything)
        moves = Moves(self._offload, restores, epoch=self.epoch, spill=self._spill, fetch=self._fetch, drop=self._drop,
                      state_offload=self._state_offload, state_restore=list(state_restores))
        written = [*(s for _, s in self._offload), *(s for _, _, s in self._state_offload)]
        self._written_next = [(slot, self.pool.hash_of[slot]) for slot in written] if self.disk is not None else []
        if self._fetch:
            self.choice.sent([h for h, _ in self._fetch])
        self._offload, self._spill, self._fetch, self._drop, self._state_offload = [], [], [], [], []
        self.restored += len(restores) + len(state_restores)
        self.states_restored += sum(1 for _, _, j in state_restores if j == 0)
        return moves

    @property
    def disk_waits(self) -> bool:
        """Whether the disk tier has moves to send or reads out whose news is awaited, or cached
        blocks wait to go through the host tier to disk (an idle daemon writes its cache out)."""
        return self.disk is not None and bool(self._spill or self._fetch or self._drop or self.fetching or self._early
                                              or self._written_next or self._early_states)

    def reset(self) -> None:
        """Forget every slot (a step that failed may have left its moves undone)."""
        self.pool.reset()
        for kept in (self._deferred, self._early, self._early_states, self.fetching):
            kept.clear()
        self._offload, self._state_offload, self._spill, self._fetch, self._written_next = [], [], [], [], []
        self.epoch += 1
