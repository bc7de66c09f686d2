"""The scheduler's part in speculative decoding: which planned decodes carry drafts (and the
blocks and recurrent-state slots they take), when the MTP layer proposes, and what a step's
checked drafts leave behind. A mixin of ``Scheduler`` (scheduler.py), whose state it reads."""

from __future__ import annotations

from .planned import Planned
from .speculative import NO_MATCH_PAUSE

DEVICE_TOKEN = -1


class DraftPlanning:
    def awaiting_drafter(self) -> bool:
        """A sequence that drafts next has its input token in flight (the lookup needs it): the
        next step waits for it, whole (a step without it would split the batch in two, each
        half a step of its own)."""
        spec = self.speculative
        if spec is None or len(self.running) > spec.decodes or (self.states.num_slots and not self.states.spare):
            return False
        return any(req.pending and req.spec is not None and req.spec.waits(self.clock, req.prompt, req.output)
                   for req in self.running)

    def draft(self, x: Planned, rows: int) -> int:
        """Drafts after a planned decode whose input token is known (speculative decoding), as
        many as its request's drafting gives, its limits and the step's ``rows`` leave room for
        and free blocks hold (beyond one in hand for each running sequence: drafts never
        preempt). Returns how many."""
        req = x.req
        if req.spec is None or rows <= 0 or x.tokens[0] == DEVICE_TOKEN or not req.spec.active(self.clock):
            return 0
        known = len(req.prompt) + len(req.output)
        room = min(req.max_tokens - len(req.output) - 1, self.max_len - known - 1, rows, self.speculative.room(known))
        drafts = req.spec.drafts(req.prompt + req.output, room, self.clock)
        if not drafts:
            return 0
        need = self.blocks.blocks_for(req.computed + len(drafts)) - len(req.blocks)
        if need > 0:
            if need > self.blocks.free_count - len(self.running):
                return 0
            self.blocks.grow(req.blocks, req.computed + len(drafts))
        if self.states.num_slots:  # recurrent state: kept after each point a rejection may come
            while len(x.draft_states) < len(drafts) and (slot := self.states.scratch()) is not None:
                x.draft_states.append(slot)
            drafts = drafts[: len(x.draft_states)]
            if not drafts:  # no slot free: as if nothing matched
                req.spec.pause(self.clock, NO_MATCH_PAUSE)
                return 0
        x.tokens = x.tokens + drafts
        x.drafts = len(drafts)
        x.blocks = req.blocks[x.block_start:]
        req.sent_blocks = len(req.blocks)
        req.computed += len(drafts)
        return len(drafts)

    def propose(self, x: Planned) -> None:
        """With the MTP drafter, a planned step of a drafting sequence runs the rank's MTP layer
        over its tokens (a prompt chunk's fill its cache) and, where it draws, asks for as many
        drafts as the next step may carry, with blocks held for the rows that guess them (beyond
        one in hand for each running sequence). The last step of a pause asks too (it still
        overlaps), so the step that ends it drafts."""
        req = x.req
        if req.spec is None or getattr(req.spec.index, "pauses", True) or not req.spec.active(self.clock + 1):
            return
        x.propose = min(req.spec.width, self.speculative.room(req.computed)) if x.sample else req.spec.most
        if not x.propose:
            return
        need = self.blocks.blocks_for(req.computed + x.propose - 1) - len(req.blocks) if x.sample else 0
        if 0 < need <= self.blocks.free_count - len(self.running):
            self.blocks.grow(req.blocks, req.computed + x.propose - 1)
            x.blocks = req.blocks[x.block_start:]
            req.sent_blocks = len(req.blocks)

    def drafts_checked(self, x: Planned, accepted: int) -> None:
        """A step's reply for a planned decode with drafts: ``accepted`` held. The positions of
        the others are not the sequence's (their K/V is written over later)."""
        req = x.req
        if req.spec is not None:
            req.spec.checked(x.drafts, accepted, self.clock)
        unused = x.drafts - accepted
        x.tokens = x.tokens[: len(x.tokens) - unused]
        scratch = x.draft_states
        if x.run == req.run and (req.slot >= 0 or req in self.closing):
            req.computed -= unused
            if unused and scratch:  # the state after the last accepted token is the sequence's now
                scratch = list(scratch)
                req.states[0], scratch[accepted] = scratch[accepted], req.states[0]
        self.states.unscratch(scratch)

    def step_snapshots(self, x: Planned) -> list[tuple[int, int]]:
        """The (position, slot) state snapshots a planned sequence's step takes: the prefix
        cache's, and with drafts of a model with recurrent state, one after each draft point."""
        if not x.draft_states:
            return x.snapshots
        return x.snapshots + [(x.start_pos + 1 + j, slot) for j, slot in enumerate(x.draft_states)]
