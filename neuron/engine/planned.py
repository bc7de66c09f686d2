"""A sequence's part in one step, as the scheduler plans it (``scheduler.py``) and the engine
sends it to the ranks (``StepSeq``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import GenRequest


@dataclass
class Planned:
    req: GenRequest
    tokens: list[int]
    start_pos: int
    sample: bool
    blocks: list[int]  # table entries the rank has not seen yet, from entry ``block_start``
    block_start: int
    start: bool  # the sequence's first step in its slot: the rank resets the slot's sampler
    run: int  # the request's run it belongs to (a preemption starts a new one)
    state_from: int = -1  # with ``start``: the snapshot slot the sequence's state starts from
    kv_from: int = -1  # with ``start``: the cached partial block its first block starts as
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (position, slot) the step keeps
    drafts: int = 0  # of ``tokens``, the last ones are guesses for the rank to check (speculative)
    # With drafts, for a model with recurrent state: the slots that take the state after the input
    # token and each draft but the last (the state to go on from if the next draft is rejected).
    draft_states: list[int] = field(default_factory=list)
    propose: int = 0  # drafts the rank's MTP layer guesses after the step (StepSeq.propose)
