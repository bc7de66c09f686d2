"""The host tier of a rank's prefix cache: KV blocks the leader evicts from the rank's cache are
copied into slots of host memory (pinned on a GPU) instead of being dropped, and copied back into
a block of the cache when a prompt that starts with them comes again (``Step.offload``,
``Step.restore``). The leader decides which slot holds which block; the rank only moves them, at
the start of the step that carries them, offloads first, so a block evicted and reused in one step
is read before it is written, on the device's stream, so a step before it has written every block
it offloads and a step after it reads every block it restores.

A slot holds one block of every layer, K then V: ``[2, layers, block_size, n_kv, head_dim]``
contiguous, one copy per run of consecutive slots. On a GPU the blocks are gathered on the device
(and scattered there on the way back) a bounded number at a time, so a move of thousands of
blocks takes little device memory.

A model with recurrent state sends its state snapshots here too (``Step.state_offload``,
``Step.state_restore``): a snapshot's bytes (``StatePool.byte_spans``) are cut into pieces of a
slot each (``pieces``), which move like blocks, in the same order, and go to disk like them."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .attention import PagedKvCache
from .host_memory import Pinned, mapped
from .inputs import StepRejected
from .sampler import upload
from .state import StatePool

if TYPE_CHECKING:
    from .disk_tier import DiskKvStore

log = logging.getLogger("neuron.runner")

CHUNK = 64  # blocks gathered (or scattered) on the device at a time
REMEDY = "lower [cache] host_gb"
IO_TIMEOUT = 60.0  # seconds a step waits at most for the disk tier's read or write of a slot


class HostKvTier:
    def __init__(self, kv: PagedKvCache, slots: int, pinned: bool, states: StatePool | None = None) -> None:
        self.kv = kv
        self.states = states
        layers, _, bs, n_kv, head_dim = kv.k.shape
        self.slots = slots
        shape = (slots, 2, layers, bs, n_kv, head_dim)
        self._pinned = Pinned(shape, kv.k.dtype, "host tier", REMEDY) if pinned else None
        self.store = self._pinned.tensor if pinned else mapped(shape, kv.k.dtype, "host tier", REMEDY)
        self.disk: DiskKvStore | None = None
        # What a host-side use of a slot must wait for: the device's last copy to or from it (an
        # event on the stream), or the disk tier's thread writing it out or reading it in.
        self._copying: dict[int, torch.cuda.Event] = {}
        self._disk_io: dict[int, Future] = {}
        self._reads: dict[int, Future] = {}
        self.pieces = -(-states.slot_bytes // self.block_bytes) if states is not None else 0

    @property
    def block_bytes(self) -> int:
        return self.store[0].numel() * self.store.element_size()

    def _bytes(self, slot: int) -> np.ndarray:
        return self._slot_bytes(slot).numpy()

    def _slot_bytes(self, slot: int) -> torch.Tensor:
        return self.store[slot].view(torch.uint8).reshape(-1)

    def _quiet(self, slot: int, wait_copy: bool = True) -> bool | None:
        """Wait until nothing else touches ``slot``: the disk tier's read or write of it (the
        read's result: whether it holds its block), and with ``wait_copy`` the device's copy."""
        event = self._copying.pop(slot, None) if wait_copy else None
        if event is not None:
            event.synchronize()
        self._reads.pop(slot, None)
        io = self._disk_io.pop(slot, None)
        if io is None:
            return None
        try:
            return io.result(timeout=IO_TIMEOUT)
        except TimeoutError:
            raise StepRejected(f"the disk tier's read or write of host slot {slot} took over {IO_TIMEOUT} s") from None

    def step_moves(self, msg) -> MoveTimes:
        """A step's moves (``Step``): the disk tier's deletions and writes, the device's copies,
        then the disk tier's reads, which go on in the background."""
        if (msg.spill or msg.fetch or msg.disk_drop) and self.disk is None:
            raise StepRejected("a step moves KV blocks to or from a disk tier this rank does not have")
        for slot, _ in [*msg.spill, *((s, h) for h, s in msg.fetch)]:
            if not 0 <= slot < self.slots:
                raise StepRejected(f"host slot {slot} is out of range ({self.slots} host slots)")
        if self.disk is not None:
            self.disk.drop(msg.disk_drop)
            for slot, h in msg.spill:  # the writer thread waits for the device's copy into the slot
                self._quiet(slot, wait_copy=False)
                done = self.disk.write(h, self._bytes(slot), self._copying.pop(slot, None))
                if done is not None:
                    self._disk_io[slot] = done
        times = self.move(msg.offload, msg.restore, msg.state_offload, msg.state_restore)
        for h, slot in msg.fetch:
            self._quiet(slot)
            self._disk_io[slot] = self._reads[slot] = self.disk.fetch(h, self._bytes(slot))
        return times

    def wait_for_disk(self, timeout: float) -> None:
        """Until every read of the disk tier is done, or with none under way until one of its
        writes is, ``timeout`` at most (a step with nothing else to do waits here for the disk
        tier's news: all reads at once, so that a prefix read in comes back in few steps)."""
        self._reads = {slot: f for slot, f in self._reads.items() if not f.done()}
        if self._reads:
            wait(list(self._reads.values()), timeout, ALL_COMPLETED)
            return
        pending = [f for f in self._disk_io.values() if not f.done()]
        if pending:
            wait(pending, timeout, FIRST_COMPLETED)

    def disk_news(self) -> tuple[list[bytes], list[bytes]]:
        """The blocks read in since the last call, and those the disk tier no longer holds."""
        fetched, lost = [], []
        for kind, h, ok in self.disk.drain() if self.disk is not None else []:
            if kind == "fetch" and ok:
                fetched.append(h)
            elif not ok or kind == "evict":
                lost.append(h)
        return fetched, lost

    def close(self) -> None:
        """Stop the disk tier's threads and unlock the pinned slots (a rank unloading its model)."""
        if self.disk is not None:
            self.disk.close()
        if self._pinned is not None:
            self._pinned.release()

    def warm(self) -> None:
        """Block 0 to host slot 0 and back, before the cache holds anything: the first restore
        after a start (a disk tier's prefix coming back) then pays no first-use costs of its ops."""
        self.move([(0, 0)], [(0, 0)])
        self._quiet(0)

    @property
    def nbytes(self) -> int:
        return self.store.numel() * self.store.element_size()

    def check(self, offload: list[tuple[int, int]], restore: list[tuple[int, int]], state_offload=(),
              state_restore=()) -> None:
        for block, slot in [*offload, *((b, s) for s, b in restore)]:
            if not 0 <= block < self.kv.blocks or not 0 <= slot < self.slots:
                raise StepRejected(f"a move between KV block {block} and host slot {slot} is out of range "
                                   f"({self.kv.blocks} blocks, {self.slots} host slots)")
        if self.states is None:  # a pipeline stage with no recurrent layer: the pieces are other ranks'
            return
        for state, piece, slot in [*state_offload, *((s, j, h) for h, s, j in state_restore)]:
            if not 0 <= state < self.states.slots or piece < 0 or not 0 <= slot < self.slots:
                raise StepRejected(f"a move between piece {piece} of state slot {state} and host slot {slot} is out "
                                   f"of range ({self.states.slots} state slots, {self.slots} host slots)")

    def move(self, offload: list[tuple[int, int]], restore: list[tuple[int, int]], state_offload=(),
             state_restore=()) -> MoveTimes:
        """Blocks into host slots (``offload``: (block, slot)) and state pieces (``state_offload``:
        (state slot, piece, slot)), then host slots into blocks (``restore``: (slot, block)) and
        into pieces (``state_restore``: (slot, state slot, piece)); the device time of each, once
        the step is done."""
        self.check(offload, restore, state_offload, state_restore)
        if self.states is None:
            state_offload = state_restore = ()
        device = self.kv.k.device
        into = [*(s for _, s in offload), *(s for _, _, s in state_offload)]
        out_of = [*(s for s, _ in restore), *(s for s, _, _ in state_restore)]
        for slot in into:  # a disk write of the slot's old block, or a read into it, may still run
            if slot in self._disk_io:
                self._quiet(slot, wait_copy=False)
        for slot in out_of:
            if slot in self._disk_io and self._quiet(slot, wait_copy=False) is False:
                raise StepRejected(f"host slot {slot}'s block could not be read from the disk tier")
        times = MoveTimes(device.type == "cuda")
        for i in range(0, len(offload), CHUNK):
            part = offload[i: i + CHUNK]
            at = upload([b for b, _ in part], torch.int64, device)
            both = torch.stack((self.kv.k.index_select(1, at), self.kv.v.index_select(1, at)))
            gathered = both.permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, 2, layers, ...]
            for j, slot, n in _runs([s for _, s in part]):
                self.store[slot: slot + n].copy_(gathered[j: j + n], non_blocking=True)
        for state, piece, slot in state_offload:
            host = self._slot_bytes(slot)
            for span, at in self.states.byte_spans(state, piece * host.numel(), host.numel()):
                host[at: at + span.numel()].copy_(span, non_blocking=True)
        times.mark()
        for i in range(0, len(restore), CHUNK):
            part = restore[i: i + CHUNK]
            staging = torch.empty((len(part), *self.store.shape[1:]), dtype=self.store.dtype, device=device)
            for j, slot, n in _runs([s for s, _ in part]):
                staging[j: j + n].copy_(self.store[slot: slot + n], non_blocking=True)
            at = upload([b for _, b in part], torch.int64, device)
            self.kv.k.index_copy_(1, at, staging[:, 0].transpose(0, 1))
            self.kv.v.index_copy_(1, at, staging[:, 1].transpose(0, 1))
        for slot, state, piece in state_restore:
            host = self._slot_bytes(slot)
            for span, at in self.states.byte_spans(state, piece * host.numel(), host.numel()):
                span.copy_(host[at: at + span.numel()], non_blocking=True)
        times.mark()
        if times.cuda:
            self._copying.update({slot: times.marks[1] for slot in into})
            self._copying.update({slot: times.marks[2] for slot in out_of})
        return times


class MoveTimes:
    """When a step's moves began, its offloads ended and its restores ended: events on the
    device's stream (read once the step's tokens are on the host), or the clock on a CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def ms(self) -> tuple[float, float]:
        """(offloads, restores) in milliseconds."""
        a, b, c = self.marks
        if self.cuda:
            return a.elapsed_time(b), b.elapsed_time(c)
        return (b - a) * 1e3, (c - b) * 1e3


def carries_moves(msg) -> bool:
    """Whether a ``Step`` moves anything between the rank and its tiers."""
    return bool(msg.offload or msg.restore or msg.spill or msg.fetch or msg.disk_drop or msg.state_offload
                or msg.state_restore)


def host_tier(kv: PagedKvCache, host_bytes: int, states: StatePool, rank: int, disk: tuple = ()) -> HostKvTier | None:
    """The rank's host tier: as many slots as ``host_bytes`` holds (for a model whose layers keep
    a recurrent state, at least two snapshots' pieces: its cached prefixes need them);
    ``disk``: (directory, bytes, model, identity) of a disk tier below it."""
    per_block = 2 * kv.k[0, 0].numel() * kv.k.shape[0] * kv.k.element_size()
    slots = host_bytes // per_block if per_block else 0
    pieces = -(-states.slot_bytes // per_block) if states.slots and per_block else 0
    if not slots or slots < 2 * pieces:
        if slots:
            log.warning("rank %d: no host tier: %d slots hold less than two state snapshots of %d slots each",
                        rank, slots, pieces)
        return None
    pinned = kv.k.device.type == "cuda"
    tier = HostKvTier(kv, slots, pinned, states if pieces else None)
    tier.warm()
    log.info("rank %d: host tier of the prefix cache: %d blocks, %.2f GB%s%s", rank, slots, tier.nbytes / 1e9,
             " pinned" if pinned else "",
             f"; a state snapshot takes {pieces} of them" if pieces else "")
    if disk and disk[0] and disk[1] >= per_block:
        from .disk_tier import DiskKvStore

        root, nbytes, model, identity = disk
        tier.disk = DiskKvStore(Path(root), model, identity, rank, tier.block_bytes, nbytes)
        log.info("rank %d: disk tier of the prefix cache in %s: %d blocks at most, %d kept from before", rank,
                 tier.disk.dir, tier.disk.capacity // tier.disk.file_bytes, len(tier.disk.files))
    return tier


def _runs(slots: list[int]):
    """(index into ``slots``, first slot, length) of each run of consecutive slots."""
    i = 0
    while i < len(slots):
        n = 1
        while i + n < len(slots) and slots[i + n] == slots[i] + n:
            n += 1
        yield i, slots[i], n
        i += n
