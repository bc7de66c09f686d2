"""The scheduler's side of the host tier (``host_tier``): a request admitted with part of its
prefix in the tier gets new blocks for it and waits for their restores, which go out with the
next steps (all of them at once when no sequence is decoding; beside decodes, a step's moves
number ``restore_per_step`` blocks at most, a restore into a block whose own offload waits for it
counting twice, so the copies do not stall the streams); its prompt runs on from the step that
carries its last restore. A restored block is cached in the rank's cache again once that step
has answered. Cached blocks are copied into the tier early with the room a step has left (four
times as much in a step with no decodes). A hybrid model's end-of-answer snapshot goes into the
tier with the partial block it hangs on, early as boundary snapshots do or as the ranks evict it;
a next turn that continues the whole of that answer restarts there (``_tier_tail``)."""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext

from .host_tier import HostTier
from .request import GenRequest
from .state_cache import tail_name
from .tier_moves import Moves


class HostPlanning:
    host: HostTier | None = None
    restore_per_step = 0

    def use_host(self, slots: int, per_step: int, disk_blocks: int = 0, disk_hashes: list[bytes] = (),
                 state_pieces: int = 0) -> None:
        """The ranks hold ``slots`` host slots; beside decodes a step restores ``per_step``
        blocks at most; below them a disk tier of ``disk_blocks`` files, holding ``disk_hashes``.
        Only where prefixes are cached, and for a model with recurrent state where its snapshots
        come too (``state_pieces`` slots each)."""
        self._restores: list[tuple[GenRequest, int, int, int, bytes]] = []  # (req, run, entry, slot, hash)
        self._moves_out: deque[Moves] = deque()  # of the steps sent, their replies not in
        self._decoding = True  # whether the step being planned decodes
        if slots and self.blocks.cache_key is not None and (not self.states.num_slots or state_pieces):
            self.host = HostTier(slots, self.blocks)
            self.restore_per_step = max(1, per_step)
            if state_pieces:
                self.host.use_states(state_pieces, self.states.holds, self.states.num_slots, self.states.is_passed)
                self.states.on_pass.append(self.host.demote)
                self.states.on_touch.append(self.host.touch_state)
                self.states.on_keep.append(self.host.note_state)
                self.states.on_evict.append(self.host.offload_state)
                self.states.on_keep_tail.append(self.host.note_state)
                self.states.on_evict_tail.append(self._tail_evicted)
            if disk_blocks:
                self.host.use_disk(disk_blocks, list(disk_hashes))

    def _restart_point(self, req: GenRequest, tokens: list[int], hits: list[int], hashes: list[bytes],
                       full: list[bytes] | None):
        """Where a model with recurrent state restarts ``tokens`` (``full``: the hashes of all its
        full blocks before the last token, None where nothing is cached): the deepest snapshot of its state
        along them, the ranks' (``StateCache.find``; its blocks in the ranks' cache or the host
        tier) or the host tier's (its pieces restored into the request's own state slot, and for
        an end-of-answer one its partial block too), and the blocks it needs. (hits, hashes,
        start, the ranks' snapshot, tier blocks, state pieces, the tier's (slot, tokens) of a
        partial block or None)."""
        if not self.states.caching:
            return [], [], 0, None, [], [], None
        bs, limit, key = self.blocks.block_size, len(tokens) - 1, self.blocks.key(req.cache_salt)
        counted = len(hits) * bs  # as match counted them
        chain = hashes + (self.host.reach(full, len(hashes)) if self.host is not None else [])
        found = self.states.find(tokens, limit, chain, key)
        depth, snap = found if found else (0, None)
        for d, n, name in self._restart_options(tokens, limit, chain, key, depth, snap):
            if name is not None and self.host.pieces + bool(n) + d - min(len(hits), d) > \
                    self.host.slots - len(self.host.pool.pins):
                continue  # more slots at once than the tier has unpinned: taking them would read some in vain
            state = self.host.take_state(name) if name is not None else []
            partial = self.host.take(name, [s for s, _ in state]) if n and state else None
            if name is not None and (not state or n and partial is None):
                continue
            own = min(len(hits), d)
            keep = [s for s, _ in state] + ([partial] if n else [])
            tiered = self.host.extend(full[:d], own, keep) if d > own else []
            if own + len(tiered) == d:
                depth, snap, tail = d, snap if name is None else None, (partial, n) if n else None
                break
        else:  # not even the ranks' snapshot's blocks: the ranks' own snapshots only
            found = self.states.find(tokens, limit, hashes, key)
            (own, snap), state, tiered, tail = found if found else (0, None), [], [], None
            depth = own
        start = snap.position if snap is not None else depth * bs + (tail[1] if tail else 0) if state else 0
        self.blocks.hits += start - counted - len(tiered) * bs  # _from_host counts the tier's blocks
        return hits[:own], hashes[:own], start, snap, tiered, state, tail

    def _restart_options(self, tokens: list[int], limit: int, chain: list[bytes], key: bytes, depth: int, snap):
        """Where ``_restart_point`` may restart, deepest first, each looked up only once the one
        before could not be had: the tier's end-of-answer snapshot, its boundary snapshots past
        the ranks' (at ``depth`` blocks, ``snap``), then the ranks'. (depth, tail tokens, name or None)."""
        if self.host is not None and self.host.pieces:
            reached = snap.position if snap is not None else depth * self.blocks.block_size
            tail = self._tier_tail(tokens, limit, chain, key, reached)
            if tail is not None:
                yield len(chain), tail[1], tail[0]
            for d in range(len(chain), depth, -1):
                if self.host.state_at(chain[d - 1]):
                    yield d, 0, chain[d - 1]
        yield depth, 0, None

    def _tier_tail(self, tokens: list[int], limit: int, chain: list[bytes], key: bytes, reached: int):
        """An end-of-answer snapshot in the tier past ``reached`` tokens, on the last block of
        ``chain`` (where a chat's next turn finds one: its blocks end where the last turn's full
        blocks did): (its name, its tokens past the block), or None."""
        bs, d = self.blocks.block_size, len(chain)
        parent = chain[-1] if chain else self.states.root(key)
        for n in range(min(bs - 1, limit - d * bs), max(0, reached - d * bs), -1):
            name = tail_name(parent, tokens[d * bs: d * bs + n])
            if self.host.has(name) and self.host.state_at(name):
                return name, n
        return None

    def _tail_evicted(self, slot: int, name: bytes, block: int) -> None:
        """An end-of-answer snapshot leaves the ranks: its pieces and its partial block go into the
        tier with the next step (unless the tier holds them)."""
        if not (self.host.has(name) and self.host.state_at(name)) and self.host.offload_state(slot, name):
            if not self.host.has(name):
                self.host.copy_block(block, name)

    def _hold_tiered(self, found: list[tuple[int, bytes]], state: list[tuple[int, bytes]] = (),
                     tail: tuple[int, int] | None = None) -> list[int]:
        """Pin the tier's slots a request being admitted found (``_from_host``'s arguments) from now
        on: taking its state slot may evict one of the ranks' snapshots into the tier, which must
        not reuse them. The slots pinned (unpinned by the caller if it is not admitted after all)."""
        held = [s for s, _ in [*found, *state]] + ([tail[0]] if tail else [])
        if held:
            self.host.pool.pin(held)
        return held

    def _from_host(self, req: GenRequest, found: list[tuple[int, bytes]], state: list[tuple[int, bytes]] = (),
                   tail: tuple[int, int] | None = None) -> None:
        """``req``'s table goes on with new blocks for the ``found`` (slot, hash) of the tier (and
        the partial block of ``tail``, (slot, tokens), never cached under a name), its state slot
        takes the pieces of ``state`` (slot, name) last: their slots pinned (``_hold_tiered``)."""
        partial = [tail[0]] if tail else []
        first = len(req.blocks)
        req.blocks += self.blocks.allocate(len(found) + len(partial))
        req.hashes = req.hashes + [h for _, h in found]
        req.restoring = [(s, first + i, h) for i, (s, h) in enumerate(found)] + \
            [(s, first + len(found), None) for s in partial] + \
            [(s, -1 - j, k) for j, (s, k) in enumerate(state)]  # a piece's entry: -1 - its index
        req.host_run = req.run
        bs, extra = self.blocks.block_size, tail[1] if tail else 0
        tokens = len(found) * bs
        tail_read = sum(extra for s in partial if s in self.host.fetching)
        from_disk = sum(s in self.host.fetching for s, _ in found) * bs + tail_read
        self.host.disk_hits += tail_read  # the blocks' own were counted as their reads were asked
        self.host.hits += tokens + extra - from_disk
        self.blocks.hits += tokens
        if not req.preempted:
            req.host_tokens, req.disk_tokens = tokens + extra, from_disk

    def _forget_restores(self, req: GenRequest) -> None:
        if req.restoring:
            self.host.pool.unpin([s for s, _, _ in req.restoring])
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
                cost = 1 + (entry >= 0 and self.host.deferred(req.blocks[entry]))
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
                if req.run == run and entry < len(req.blocks) and (entry >= 0 or req.states)]
        bs = self.blocks.block_size
        written = {b for x in plan for b in x.req.blocks[x.start_pos // bs: (x.start_pos + len(x.tokens) - 1) // bs + 1]} \
            if self.host.deferred_any else set()
        moves = self.host.take_moves([(slot, req.blocks[entry]) for req, _, entry, slot, _ in live if entry >= 0],
                                     self.restore_per_step * (1 if self._decoding else 4), written,
                                     not self._decoding,
                                     [(slot, req.states[0], -1 - entry) for req, _, entry, slot, _ in live if entry < 0])
        self.host.pool.unpin([slot for _, _, _, slot, _ in self._restores])  # once no offload of the step may take them
        self._restores = []
        moves.cached = [(req, run, entry, h) for req, run, entry, _, h in live if entry >= 0 and h is not None]
        self._moves_out.append(moves)
        return moves

    def step_took(self, plan: list, seconds: float) -> None:
        """A step's time on the ranks: its prompt tokens' rate weighs reading against computing."""
        if self.host is not None and self.host.disk is not None:
            self.host.choice.computed(sum(len(x.tokens) for x in plan if len(x.tokens) > 1 and not x.drafts), seconds)

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
            self.host.pool.free.extend(failed)
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
        self.host.pool.unpin([slot for _, _, _, slot, _ in self._restores])
        self._restores = []
        self.host.reset()
