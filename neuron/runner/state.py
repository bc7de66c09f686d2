"""The per-sequence state of a model's recurrent layers: for each such layer, its state tensors
(``RecurrentState.shapes``) for every state slot, plus one scratch slot. The leader assigns each
running sequence a slot (``StepSeq.state``); the runner clears it at the sequence's first step.
A slot can be copied into another: a snapshot of a sequence's state at a block boundary, and its
restore into the slot of a sequence that reuses that prefix (the prefix cache of hybrid models)."""

from __future__ import annotations

import torch

from neuron.models.interface import LayerState, RecurrentState


class StatePool:
    def __init__(self, specs: list[LayerState], slots: int, device: torch.device) -> None:
        self.specs = [s for s in specs if isinstance(s, RecurrentState)]
        self.slots = slots if self.specs else 0
        self.scratch = self.slots
        self.tensors = [[torch.zeros((self.slots + 1, *shape), device=device, dtype=spec.dtype)
                         for shape in spec.shapes] for spec in self.specs]

    @staticmethod
    def bytes_per_slot(specs: list[LayerState]) -> int:
        total = 0
        for spec in specs:
            if isinstance(spec, RecurrentState):
                item = torch.empty(0, dtype=spec.dtype).element_size()
                total += sum(item * _numel(shape) for shape in spec.shapes)
        return total

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.tensors for t in layer)

    def layer(self, index: int) -> list[torch.Tensor]:
        """The state tensors of the ``index``-th recurrent layer, [slots + 1, *shape] each."""
        return self.tensors[index]

    def clear(self, slots: list[int]) -> None:
        if not slots or not self.tensors:
            return
        at = torch.tensor(slots, dtype=torch.long, device=self.tensors[0][0].device)
        for layer in self.tensors:
            for t in layer:
                t.index_fill_(0, at, 0)

    def copy(self, src: int, dst: int) -> None:
        """Slot ``dst`` takes the state of slot ``src`` (a snapshot, or its restore)."""
        for layer in self.tensors:
            for t in layer:
                t[dst].copy_(t[src])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
