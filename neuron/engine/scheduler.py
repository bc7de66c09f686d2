"""Continuous batching over a paged KV cache: which sequences run in the next step, with how many
tokens, and in which KV blocks (and, for a model with recurrent layers, which state slot).

Every step first carries one decode token for each running sequence, then fills the rest of the
token budget with prompt chunks (chunked prefill), so a long prompt never stalls the streams
already decoding. Waiting requests are admitted in fair order between principals (``fair``),
each when a slot is free, its prompt's blocks fit and, where the model keeps per-sequence state, a
state slot is free (it waits otherwise); a decode that needs a block when none is free preempts
the newest running request of the principal holding the most blocks, which gives back its blocks
and its state slot, goes back to the front of the queue and is recomputed later (its client sees
nothing but a pause). A principal with nothing running that waits while every slot is taken gets
one at the next step: the newest request of the principal running the most (two or more) gives
its slot up the same way, and waits at the head of its own principal's queue.

Steps overlap: the next step is planned while the last is still running. A decode whose input
token is still in flight (``pending``) is sent as ``-1``, which the rank resolves on the device.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque

from .blocks import BlockManager, OutOfBlocks
from .fair import FairQueue, slot_victim
from .host_planning import HostPlanning
from .draft_planning import DEVICE_TOKEN, DraftPlanning
from .planned import Planned
from .request import GenRequest
from .speculative import DraftPolicy, Speculation, may_draft
from .state_cache import StateCache, tail_name
from .step_budget import StepBudget, prompt_takes



class Scheduler(DraftPlanning, HostPlanning):
    def __init__(self, max_slots: int, max_len: int, num_blocks: int, block_size: int, max_batch_tokens: int,
                 prefill_chunk: int, prefill_chunk_decoding: int | None = None,
                 cache_key: bytes | None = None, state_slots: int = 0, state_snapshots: int = 0,
                 snapshot_interval: int = 512, speculative: DraftPolicy | None = None,
                 step_budget: StepBudget | None = None) -> None:
        self.max_slots, self.max_len = max_slots, max_len
        self.step_budget = step_budget  # None: prompt chunks beside decodes of prefill_chunk_decoding
        self.speculative = speculative  # None: no speculative decoding
        # A constrained sequence may have a token in flight when it is planned again: its mask
        # then follows the step (late_masks.py). False: it waits for the token, and the mask.
        self.late_masks = False
        self.max_batch_tokens, self.prefill_chunk = max_batch_tokens, prefill_chunk
        self.prefill_chunk_decoding = prefill_chunk_decoding or prefill_chunk
        # A recurrent layer's state cannot be rebuilt from cached K/V blocks: its prefix cache
        # needs state snapshots (state_cache), and is off without slots for them.
        self.blocks = BlockManager(num_blocks, block_size, None if state_slots and not state_snapshots else cache_key)
        # With drafts, the slots the ranks hold for the states after them (ModelRunner).
        spare = speculative.rows - 1 if speculative and state_slots else 0
        self.states = StateCache(state_slots, self.blocks, snapshot_interval, spare)
        self.closing: set[GenRequest] = set()  # finished, their last steps still out: snapshots to come
        self.free_slots: deque[int] = deque(range(max_slots))
        self.waiting = FairQueue()
        self.running: list[GenRequest] = []  # in admission order: the last is the newest
        self.preemptions = 0
        self.clock = 0  # steps planned (speculative decoding's pauses count these)
        self._order = itertools.count()
        self.use_host(0, 0)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    # ----------------------------------------------------------------------------- admission
    def admit(self) -> list[GenRequest]:
        """Give slots and blocks to waiting requests: preempted first, then in fair order."""
        admitted = []
        running = Counter(r.principal for r in self.running)
        while self.waiting:
            full = not self.free_slots
            req = self.waiting.next(running, idle=full)
            if req is None:
                break
            if req.cancelled or req.finished:
                self.waiting.remove(req)
                continue
            if req.pending:  # preempted with a token in flight: recompute once it is known
                break
            if full and not self._yield_slot(req, running):
                break
            tokens, tiered, state, tail = req.keyed(), [], [], None
            # The longest cached prefix of whole blocks; the last token is always computed, since
            # its logits give the next token.
            chain = req.chain((len(tokens) - 1) // self.blocks.block_size, self.blocks.key(req.cache_salt),
                              self.blocks.block_size) if self.blocks.cache_key is not None else None
            hits, hashes = self.blocks.match(tokens, len(tokens) - 1, req.cache_salt, chain)
            start, snap = len(hits) * self.blocks.block_size, None
            if self.states.num_slots:  # cached K/V is of use only up to a snapshot of the state
                hits, hashes, start, snap, tiered, state, tail = self._restart_point(req, tokens, hits, hashes, chain)
            elif self.host is not None:  # the cached prefix may run on in the host tier
                tiered = self.host.extend(chain, len(hashes))
                start += len(tiered) * self.blocks.block_size
            held = self._hold_tiered(tiered, state, tail)
            need = self.blocks.blocks_for(len(tokens)) - len(hits) + self.blocks.revived(hits)
            # Keep a block in hand for each running sequence, which may cross into a new one next.
            if need > self.blocks.free_count - len(self.running) or \
                    self.states.num_slots and self.states.free_count <= (snap is not None and not snap.pins):
                if held:
                    self.host.pool.unpin(held)
                break
            self.waiting.pop(req)
            running[req.principal] += 1
            req.slot = self.free_slots.popleft()
            if snap is not None:
                self.states.pin(snap)
                req.restore = snap
            if self.states.num_slots:
                req.states = [self.states.allocate()]
            self.blocks.take(hits)
            req.blocks, req.hashes = list(hits), hashes
            req.state_tiered = bool(state)
            with self.admitting(req):
                if tiered or state:
                    self._from_host(req, tiered, state, tail)
                self.blocks.grow(req.blocks, len(tokens))
            req.sent_blocks = 0
            req.computed = req.confirmed = req.snapshot_floor = start
            if self.states.num_slots and start:
                parent, tail = self._point(req, start)
                if start % self.states.interval:  # an earlier turn's end, say
                    req.passing, req.passing_start = tail_name(parent, tail) if tail else parent, True
                else:  # a prefix others may share
                    self.states.share(parent)
                self.states.touch_path(req.hashes[: start // self.blocks.block_size])
            if not req.preempted:
                req.cached_tokens = req.computed
            req.order = next(self._order)
            if self.speculative and req.spec is None and may_draft(req.sampling, req.constraint is not None) \
                    and not (self.speculative.method == "mtp" and req.images):
                drafter = self.speculative.drafter(req.prompt)
                if drafter is not None:
                    req.spec = Speculation(self.speculative.tokens, drafter)
            self.running.append(req)
            admitted.append(req)
        return admitted

    def _yield_slot(self, req: GenRequest, running: Counter) -> bool:
        """No slot is free for ``req``: if its principal has nothing running and another runs
        several, that one's newest request gives its slot (and blocks) up, when they are enough
        for ``req``'s prompt, and waits at the head of its own queue."""
        victim = slot_victim(self.running, req)
        if victim is None or self.blocks.blocks_for(len(req.keyed())) > \
                self.blocks.free_count + len(victim.blocks) - len(self.running) + 1:
            return False
        self._preempt(victim, requeue=True)
        running[victim.principal] -= 1
        return True

    def release(self, req: GenRequest, keep: bool = False) -> None:
        """The request is done (finished, aborted or failed): its slot and blocks are free now.
        A step still in flight may write them once more; the rank runs steps in order, so
        whoever gets them next overwrites that before reading. ``keep`` (it finished well): a
        model with recurrent state keeps its last state as a snapshot, once its steps are in."""
        if req.spec is not None and keep:
            self.speculative.answered(req.prompt, req.output)
        if req in self.running:
            self.running.remove(req)
            self.free_slots.append(req.slot)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._unpin(req)
        req.slot = -1
        if keep and self.states.caching and req.states and 0 < req.computed <= len(req.prompt) + len(req.output):
            self.closing.add(req)
            if req.confirmed >= req.computed:
                self._close(req)
            return
        self._drop(req)

    def _drop(self, req: GenRequest) -> None:
        self.closing.discard(req)
        self._forget_restores(req)
        self.blocks.release(req.blocks)
        self.states.release(req.states)
        req.hashes = []

    def _close(self, req: GenRequest) -> None:
        """A finished request's steps are all in: its state becomes the snapshot of its tokens so
        far (the next turn of a chat starts there), its full blocks are cached, and its partial
        last block stays with the snapshot."""
        self.closing.discard(req)
        n = req.computed
        self._register(req, n // self.blocks.block_size)
        parent, tail = self._point(req, n)
        self.states.keep(req.states.pop(), n, parent, tail, req.blocks[n // self.blocks.block_size] if tail else -1,
                         running=True)
        if req.passing:
            self.states.passed(req.passing, req.passing_start)
            req.passing = b""
        self._drop(req)

    def _point(self, req: GenRequest, n: int) -> tuple[bytes, tuple[int, ...]]:
        """What keys a snapshot after ``req``'s first ``n`` tokens: the hash of its last full block
        (cached), and the tokens past it."""
        full = n // self.blocks.block_size
        parent = req.hashes[full - 1] if full else self.states.root(self.blocks.key(req.cache_salt))
        return parent, tuple(req.keyed()[full * self.blocks.block_size: n])

    def _unpin(self, req: GenRequest) -> None:
        if req.restore is not None:
            self.states.unpin(req.restore)
            req.restore = None

    def _register(self, req: GenRequest, full: int) -> None:
        """Cache the request's first ``full`` blocks (their K/V is computed) under their hashes."""
        if len(req.hashes) >= full:
            return
        chain = req.chain(full, self.blocks.key(req.cache_salt), self.blocks.block_size)
        for i in range(len(req.hashes), full):
            self.blocks.register(req.blocks[i], chain[i])
            req.hashes.append(chain[i])

    def abandon(self, plan: list[Planned]) -> None:
        """A step failed: the snapshots it was to take are not kept, nor those of the requests
        that finished while it was out."""
        self._host_failed()
        for x in plan:
            for _, slot in x.snapshots:
                self.states.abandon(slot)
            self.states.unscratch(x.draft_states)
            if x.req in self.closing:
                self._drop(x.req)

    def completed(self, plan: list[Planned], fetched: list[bytes] = (), lost: list[bytes] = ()) -> None:
        """A step's reply is in: its K/V exists. Register the blocks it filled for reuse, and the
        state snapshots it took."""
        self._host_answered(fetched, lost)
        bs = self.blocks.block_size
        for x in plan:
            req = x.req
            closing = req in self.closing
            if x.run != req.run or (req.slot < 0 and not closing):
                for _, slot in x.snapshots:  # preempted (or done) since: that run's blocks are gone
                    self.states.abandon(slot)
                continue
            req.confirmed = max(req.confirmed, x.start_pos + len(x.tokens))
            if self.blocks.cache_key is None:
                continue
            self._register(req, req.confirmed // bs)
            for at, slot in x.snapshots:
                if self.states.keep(slot, at, req.hashes[at // bs - 1]):
                    self._kept(req, at, req.hashes[at // bs - 1])
            if closing and req.confirmed >= req.computed:
                self._close(req)

    def _kept(self, req: GenRequest, at: int, h: bytes) -> None:
        """``req`` kept a snapshot of its own after ``at`` tokens (block ``h``) inside its prompt:
        the one before it is passed (``StateCache.passed``); so is this one when ``req`` ends with
        its answer's (``_close``)."""
        if req.passing:
            self.states.passed(req.passing, req.passing_start)
        req.passing, req.passing_start = h, False

    def _preempt(self, req: GenRequest, requeue: bool = False) -> None:
        self.running.remove(req)
        self.free_slots.append(req.slot)
        self._unpin(req)
        self._forget_restores(req)
        self.blocks.release(req.blocks)
        self.states.release(req.states)
        req.slot, req.computed, req.confirmed, req.sent_blocks, req.hashes = -1, 0, 0, 0, []
        req.preempted += 1
        req.run += 1
        self.preemptions += 1
        self.waiting.requeue(req) if requeue else self.waiting.appendleft(req)

    # ----------------------------------------------------------------------------- planning
    def schedule(self, group: int = 0, groups: int = 1) -> list[Planned]:
        """The next step. Its plan is already counted in each request (computed, pending,
        blocks): the step after it can be planned before this one's reply arrives. With
        ``groups`` (pipeline stages' micro-batches), only the running requests of ``group``
        (by slot)."""
        budget = self.max_batch_tokens
        plan: list[Planned] = []
        if self.awaiting_drafter():
            return plan
        for req in list(self.running):  # decodes are never held back by the budget
            if req.slot < 0 or req.slot % groups != group or req.restoring or not self._may_decode(req):  # -1: preempted
                continue
            if not self._room_for(req, req.computed + 1):
                continue
            token = req.output[-1] if not req.pending else DEVICE_TOKEN
            plan.append(self._plan(req, [token], True))
            budget -= 1
        if self.speculative and len(plan) <= self.speculative.decodes:
            rows = len(plan)
            for x in plan:
                rows += self.draft(x, self.speculative.rows - rows)
                self.propose(x)
        self.clock += bool(plan)
        if self.host is not None:
            self._drain_restores(bool(plan))
        # Beside running decodes a step takes a smaller prompt chunk: it sets their latency.
        chunk = self._chunk_beside(sum(len(x.tokens) for x in plan)) if plan else self.prefill_chunk
        prompts = [req for req in self.running if req.slot % groups == group and not req.pending and req.rest > 0
                   and not req.restoring and (self.late_masks or not _mask_due(req))]
        for req, n in prompt_takes(prompts, budget, chunk, bool(plan) and self.step_budget is not None):
            known = req.prompt + req.output
            last = req.computed + n == len(known)
            plan.append(self._plan(req, known[req.computed: req.computed + n], last and self._may_sample(req)))
            self.propose(plan[-1])
        return plan

    def _chunk_beside(self, rows: int) -> int:
        if self.step_budget is not None:
            return self.step_budget.chunk(rows) or self.prefill_chunk_decoding
        return self.prefill_chunk_decoding

    def _may_sample(self, req: GenRequest) -> bool:
        drawn = len(req.output) + req.pending
        return (not req.finished and not req.cancelled and drawn < req.max_tokens
                and len(req.prompt) + drawn < self.max_len
                and not (req.constraint is not None
                         and (req.pending > 1 if self.late_masks else req.pending or _mask_due(req))))

    def _may_decode(self, req: GenRequest) -> bool:
        """All its tokens but the last (known or in flight) are in the KV cache."""
        total = len(req.prompt) + len(req.output) + req.pending
        return req.computed == total - 1 and bool(req.output or req.pending) and self._may_sample(req)

    def _room_for(self, req: GenRequest, tokens: int) -> bool:
        """Blocks for ``tokens`` positions of ``req``, preempting running requests until they
        fit (the newest of the principal holding the most blocks); False if ``req`` had to go."""
        while True:
            try:
                self.blocks.grow(req.blocks, tokens)
                return True
            except OutOfBlocks:
                held = Counter()
                for r in self.running:
                    held[r.principal] += len(r.blocks)
                most = max(held.values())
                victim = max((r for r in self.running if held[r.principal] == most), key=lambda r: r.order)
                self._preempt(victim)
                if victim is req:
                    return False

    def _plan(self, req: GenRequest, tokens: list[int], sample: bool) -> Planned:
        x = Planned(req, tokens, req.computed, sample, req.blocks[req.sent_blocks:], req.sent_blocks,
                    start=req.sent_blocks == 0, run=req.run)
        if x.start and req.restore is not None:
            x.state_from, x.kv_from = req.restore.slot, req.restore.block
            self._unpin(req)
        elif x.start and req.state_tiered:  # its slot holds the state the host tier gave it
            x.state_from = req.states[0]
        if self.states.caching and req.computed < len(req.prompt):
            for at in self.states.prompt_points(req.computed, req.computed + len(tokens), len(req.prompt),
                                                req.snapshot_floor):
                slot = self.states.reserve()
                if slot is None:
                    break
                x.snapshots.append((at, slot))
        req.sent_blocks = len(req.blocks)
        req.computed += len(tokens)
        if sample:
            req.pending += 1
        return x


def _mask_due(req: GenRequest) -> bool:
    """Its constraint runs in an API process whose mask for its next token has not come yet
    (``core/link.py``): without late masks nothing of it may run, not even its last token as a
    chunk."""
    return getattr(req.constraint, "waiting", False)
