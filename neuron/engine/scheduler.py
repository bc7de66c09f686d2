"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step first carries one decode token for each running sequence, then fills the rest of
the token budget with prompt chunks (chunked prefill), so a long prompt never stalls the
streams already decoding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .request import GenRequest, pending_tokens


@dataclass
class Planned:
    req: GenRequest
    tokens: list[int]
    start_pos: int
    sample: bool


class Scheduler:
    def __init__(self, max_slots: int, max_batch_tokens: int, prefill_chunk: int) -> None:
        self.free_slots: deque[int] = deque(range(max_slots))
        self.max_slots = max_slots
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[GenRequest] = deque()
        self.running: list[GenRequest] = []

    def admit(self) -> list[GenRequest]:
        """Give free slots to waiting requests, oldest first."""
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            if req.cancelled:
                continue
            req.slot = self.free_slots.popleft()
            self.running.append(req)
            admitted.append(req)
        return admitted

    def release(self, req: GenRequest) -> None:
        if req in self.running:
            self.running.remove(req)
            self.free_slots.append(req.slot)
        elif req in self.waiting:
            self.waiting.remove(req)

    def plan(self) -> list[Planned]:
        budget = self.max_batch_tokens
        steps: list[Planned] = []
        decoding = [r for r in self.running if r.computed >= len(r.prompt)]
        prefilling = [r for r in self.running if r.computed < len(r.prompt)]
        for req in decoding:
            tokens = pending_tokens(req)
            steps.append(Planned(req, tokens, req.computed, True))
            budget -= len(tokens)
        for req in prefilling:
            if budget <= 0:
                break
            remaining = pending_tokens(req)
            n = min(len(remaining), self.prefill_chunk, budget)
            steps.append(Planned(req, remaining[:n], req.computed, n == len(remaining)))
            budget -= n
        return steps

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting
