"""The scheduler's side of the host tier (``host_tier``): a request admitted with part of its
prefix in the tier gets new blocks for it and waits for their restores, which go out with the
next steps (all of them at once when no sequence is decoding; beside decodes, a step's moves
number ``restore_per_step`` blocks at most, a restore into a block whose own offload waits for it
counting twice, so the copies do not stall the streams); its prompt runs on from the step that
carries its last restore. A restored block is cached in the rank's cache again once that step
has answered. Cached blocks are copied into the tier early with the room a step has left (four
times as much in a step with no decodes)."""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext

from .host_tier import HostTier, Moves
from .request import GenRequest


class HostPlanning:
    host: HostTier | None = None
    restore_per_step = 0

    def use_host(self, slots: int, per_step: int, disk_blocks: int = 0, disk_hashes: list[bytes] = ()) -> None:
        """The ranks hold ``slots`` host slots; beside decodes a step restores ``per_step``
        blocks at most; below them a disk tier of ``disk_blocks`` files, holding ``disk_hashes``.
        Only where prefixes are cached and the model keeps no recurrent state."""
        self._restores: list[tuple[GenRequest, int, int, int, bytes]] = []  # (req, run, entry, slot, hash)
        self._moves_out: deque[Moves] = deque()  # of the steps sent, their replies not in
        self._decoding = True  # whether the step being planned decodes
        if slots and self.blocks.cache_key is not None and not self.states.num_slots:
            self.host = HostTier(slots, self.blocks)
            self.restore_per_step = max(1, per_step)
            if disk_blocks:
                self.host.use_disk(disk_blocks, list(disk_hashes))

    def _from_host(self, req: GenRequest, found: list[tuple[int, bytes]]) -> None:
        """``req``'s table goes on with new blocks for the ``found`` (slot, hash) of the tier."""
        self.host.pin([s for s, _ in found])
        first = len(req.blocks)
        req.blocks += self.blocks.allocate(len(found))
        req.hashes = req.hashes + [h for _, h in found]
        req.restoring = [(s, first + i, h) for i, (s, h) in enumerate(found)]
        req.host_run = req.run
        tokens = len(found) * self.blocks.block_size
        from_disk = sum(s in self.host.fetching for s, _ in found) * self.blocks.block_size
        self.host.hits += tokens - from_disk
        self.blocks.hits += tokens
        if not req.preempted:
            req.host_tokens, req.disk_tokens = tokens, from_disk

    def _forget_restores(self, req: GenRequest) -> None:
        if req.restoring:
            self.host.unpin([s for s, _, _ in req.restoring])
            req.restoring = []

    def _drain_restores(self, decoding: bool) -> None:
        """Restores of the running requests into the next step, fewest first beside decodes."""
        self._decoding = decoding
        room = self.restore_per_step - len(self._restores) if decoding else 1 << 30
        for req in sorted((r for r in self.running if r.restoring), key=lambda r: len(r.restoring)):
            n = 0
            for slot, entry, _ in req.restoring:
                if slot in self.host.fetching:  # still being read from disk
                    break
                cost = 1 + self.host.deferred(req.blocks[entry])
                if cost > room and (n or self._restores):
                    break
                room -= cost
                n += 1
            take, req.restoring = req.restoring[:n], req.restoring[n:]
            self._restores += [(req, req.run, entry, slot, h) for slot, entry, h in take]
            if room <= 0:
                break

    def admitting(self, req: GenRequest):
        """While ``req`` takes its blocks: those evicted for it are offloaded when it writes them."""
        return self.host.held_by(req) if self.host is not None else nullcontext()

    def take_moves(self, plan: list) -> Moves | None:
        """What the step being sent (``plan``) moves between the ranks' caches and the host tier
        (a restore of a request preempted or gone since it was planned is dropped)."""
        if self.host is None:
            return None
        live = [(req, run, entry, slot, h) for req, run, entry, slot, h in self._restores
                if req.run == run and entry < len(req.blocks)]
        bs = self.blocks.block_size
        written = {b for x in plan for b in x.req.blocks[x.start_pos // bs: (x.start_pos + len(x.tokens) - 1) // bs + 1]} \
            if self.host.deferred_any else set()
        moves = self.host.take_moves([(slot, req.blocks[entry]) for req, _, entry, slot, _ in live],
                                     self.restore_per_step * (1 if self._decoding else 4), written,
                                     not self._decoding)
        self.host.unpin([slot for _, _, _, slot, _ in self._restores])  # once no offload of the step may take them
        self._restores = []
        moves.cached = [(req, run, entry, h) for req, run, entry, _, h in live]
        self._moves_out.append(moves)
        return moves

    def disk_waits(self) -> bool:
        """Whether a step with no sequences should go out: for the disk tier's moves or news."""
        return self.host is not None and self.host.disk_waits

    def _host_answered(self, fetched: list[bytes] = (), lost: list[bytes] = ()) -> None:
        """The oldest step out has answered: the blocks it restored hold their K/V again; the
        disk tier's news with it (a request waiting for a block that could not be read starts again)."""
        if self.host is None or not self._moves_out:
            return
        if fetched or lost:
            failed = set(self.host.news(fetched, lost))
            for req in [r for r in self.running if failed.intersection(s for s, _, _ in r.restoring)]:
                self._preempt(req, requeue=True)
            self.host.free(list(failed))
        moves = self._moves_out.popleft()
        if moves.epoch != self.host.epoch:
            return
        for req, run, entry, h in moves.cached:
            if req.run == run and entry < len(req.blocks) and (req.slot >= 0 or req in self.closing):
                self.blocks.register(req.blocks[entry], h)

    def _host_failed(self) -> None:
        """The oldest step out failed, perhaps with its moves undone: the tier forgets its slots,
        and every running request that took blocks from it in this run starts again."""
        if self.host is None or not self._moves_out:
            return
        self._moves_out.popleft()
        for req in [r for r in self.running if r.host_run == r.run]:
            self._preempt(req, requeue=True)
        self.host.unpin([slot for _, _, _, slot, _ in self._restores])
        self._restores = []
        self.host.reset()
