"""The sampled tokens between pipeline stages. Only the first stage embeds token ids, so the
sampling rank (tensor rank 0 of the last stage) sends each step's tokens to the first stage's
ranks, and those receive them only when a step asks for one of them (a decode whose input is
still on the device, ``-1``): while the last stage samples one group of sequences, the first
can already run another group's step (micro-batches; the leader plans the groups in turn)."""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from neuron.models.stages import Stage


class StageTokens:
    def __init__(self, stage: Stage, rank: int, last_token: torch.Tensor) -> None:
        self.stage, self.rank, self.last_token = stage, rank, last_token
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.expected: deque[tuple[int, list[int]]] = deque()  # (message number, its slots)
        self.message_of: dict[int, int] = {}  # slot -> the message number of its last draw
        self.posted = self.received = 0

    @property
    def receives(self) -> bool:
        return self.stage.first and self.rank != self.stage.sampler

    def after_step(self, tokens: torch.Tensor, slots: list[int]) -> None:
        """A step drew ``tokens`` for ``slots``."""
        if self.rank == self.stage.sampler:
            self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
            # A copy: a decode graph's tokens live in its output buffer, which the next replay
            # overwrites while the send may still be reading it.
            tokens = tokens.clone()
            for dst in range(self.stage.tensor):  # the first stage's ranks are 0 .. tensor-1
                self.sends.append((dist.isend(tokens, dst), tokens))
        elif self.receives:
            self.posted += 1
            self.expected.append((self.posted, slots))
            for slot in slots:
                self.message_of[slot] = self.posted

    def before_step(self, device_slots: list[int]) -> None:
        """Receive, in order, the tokens up to the newest draw of any of ``device_slots``."""
        if not self.receives:
            return
        need = max((self.message_of.get(s, 0) for s in device_slots), default=0)
        while self.received < need:
            number, slots = self.expected.popleft()
            got = torch.empty(len(slots), dtype=torch.int64, device=self.last_token.device)
            dist.recv(got, src=self.stage.sampler)
            self.last_token[torch.tensor(slots, device=got.device)] = got
            self.received = number
