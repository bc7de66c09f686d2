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
blocks takes little device memory."""

from __future__ import annotations

import logging
import time

import torch

from .attention import PagedKvCache
from .inputs import StepRejected
from .sampler import upload

log = logging.getLogger("neuron.runner")

CHUNK = 64  # blocks gathered (or scattered) on the device at a time


class HostKvTier:
    def __init__(self, kv: PagedKvCache, slots: int, pinned: bool) -> None:
        self.kv = kv
        layers, _, bs, n_kv, head_dim = kv.k.shape
        self.slots = slots
        self.store = torch.empty((slots, 2, layers, bs, n_kv, head_dim), dtype=kv.k.dtype, pin_memory=pinned)

    @property
    def nbytes(self) -> int:
        return self.store.numel() * self.store.element_size()

    def check(self, offload: list[tuple[int, int]], restore: list[tuple[int, int]]) -> None:
        for block, slot in [*offload, *((b, s) for s, b in restore)]:
            if not 0 <= block < self.kv.blocks or not 0 <= slot < self.slots:
                raise StepRejected(f"a move between KV block {block} and host slot {slot} is out of range "
                                   f"({self.kv.blocks} blocks, {self.slots} host slots)")

    def move(self, offload: list[tuple[int, int]], restore: list[tuple[int, int]]) -> MoveTimes:
        """Blocks into host slots (``offload``: (block, slot)), then host slots into blocks
        (``restore``: (slot, block)); the device time of each, once the step is done."""
        self.check(offload, restore)
        device = self.kv.k.device
        times = MoveTimes(device.type == "cuda")
        for i in range(0, len(offload), CHUNK):
            part = offload[i: i + CHUNK]
            at = upload([b for b, _ in part], torch.int64, device)
            both = torch.stack((self.kv.k.index_select(1, at), self.kv.v.index_select(1, at)))
            gathered = both.permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, 2, layers, ...]
            for j, slot, n in _runs([s for _, s in part]):
                self.store[slot: slot + n].copy_(gathered[j: j + n], non_blocking=True)
        times.mark()
        for i in range(0, len(restore), CHUNK):
            part = restore[i: i + CHUNK]
            staging = torch.empty((len(part), *self.store.shape[1:]), dtype=self.store.dtype, device=device)
            for j, slot, n in _runs([s for s, _ in part]):
                staging[j: j + n].copy_(self.store[slot: slot + n], non_blocking=True)
            at = upload([b for _, b in part], torch.int64, device)
            self.kv.k.index_copy_(1, at, staging[:, 0].transpose(0, 1))
            self.kv.v.index_copy_(1, at, staging[:, 1].transpose(0, 1))
        times.mark()
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


def host_tier(kv: PagedKvCache, host_bytes: int, recurrent: bool, rank: int) -> HostKvTier | None:
    """The rank's host tier: as many slots as ``host_bytes`` holds (none for a model whose layers
    keep a recurrent state: its cached prefixes need state snapshots, which stay in the rank)."""
    per_block = 2 * kv.k[0, 0].numel() * kv.k.shape[0] * kv.k.element_size()
    slots = host_bytes // per_block if per_block and not recurrent else 0
    if not slots:
        return None
    tier = HostKvTier(kv, slots, kv.k.device.type == "cuda")
    log.info("rank %d: host tier of the prefix cache: %d blocks, %.2f GB%s", rank, slots, tier.nbytes / 1e9,
             " pinned" if kv.k.device.type == "cuda" else "")
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
