"""The per-sequence state of a model's recurrent layers: for each such layer, its state tensors
(``RecurrentState.shapes``) for every state slot, plus one scratch slot (the padded rows of a CUDA
graph write there). The leader assigns each running sequence a slot (``StepSeq.state``); the
runner clears it at the sequence's first step. A slot can be copied into another: a snapshot of
a sequence's state at a block boundary, and its restore into the slot of a sequence that reuses
that prefix (the prefix cache of hybrid models).

A slot's tensors of one dtype lie together in one buffer (a row of ``[slots + 1, bytes of a slot]``),
so clearing or copying slots is one launch per dtype whatever the number of layers; each layer's
tensors are views into it, ``[slots + 1, *shape]`` with the slot stride of the buffer."""

from __future__ import annotations

import torch

from neuron.models.interface import LayerState, RecurrentState


class StatePool:
    def __init__(self, specs: list[LayerState], slots: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.specs = [s for s in specs if isinstance(s, RecurrentState)]
        self.slots = slots if self.specs else 0
        self.scratch = self.slots
        widths: dict[torch.dtype, int] = {}
        placed: list[list[tuple[torch.dtype, int, tuple[int, ...]]]] = []
        for spec in self.specs:
            layer = []
            for i, shape in enumerate(spec.shapes):
                d = spec.dtype(i, dtype)
                layer.append((d, widths.get(d, 0), shape))
                widths[d] = widths.get(d, 0) + _numel(shape)
            placed.append(layer)
        self.buffers = {d: torch.zeros(self.slots + 1, w, device=device, dtype=d) for d, w in widths.items()}
        self.tensors = [[self.buffers[d][:, at: at + _numel(shape)].view(self.slots + 1, *shape)
                         for d, at, shape in layer] for layer in placed]

    @staticmethod
    def bytes_per_slot(specs: list[LayerState], dtype: torch.dtype = torch.float32) -> int:
        total = 0
        for spec in specs:
            if isinstance(spec, RecurrentState):
                total += sum(torch.empty(0, dtype=spec.dtype(i, dtype)).element_size() * _numel(shape)
                             for i, shape in enumerate(spec.shapes))
        return total

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def slot_bytes(self) -> int:
        return sum(b.shape[1] * b.element_size() for b in self.buffers.values())

    def byte_spans(self, slot: int, start: int, n: int) -> list[tuple[torch.Tensor, int]]:
        """Bytes ``start`` to ``start + n`` of ``slot``'s state (its buffers' rows one after the
        other): (a view of them, where it begins in that range) for each buffer they cross."""
        spans, at = [], 0
        for b in self.buffers.values():
            row = b[slot].view(torch.uint8)
            lo, hi = max(start, at), min(start + n, at + row.numel())
            if lo < hi:
                spans.append((row[lo - at: hi - at], lo - start))
            at += row.numel()
        return spans

    def layer(self, index: int) -> list[torch.Tensor]:
        """The state tensors of the ``index``-th recurrent layer, [slots + 1, *shape] each."""
        return self.tensors[index]

    def clear(self, slots: list[int]) -> None:
        if not slots or not self.buffers:
            return
        at = torch.tensor(slots, dtype=torch.long).to(next(iter(self.buffers.values())).device, non_blocking=True)
        for b in self.buffers.values():
            b.index_fill_(0, at, 0)

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Slots ``dst`` take the states of slots ``src`` (snapshots, or their restores)."""
        if not src:
            return
        device = next(iter(self.buffers.values())).device
        at = torch.tensor([src, dst], dtype=torch.long).to(device, non_blocking=True)
        for b in self.buffers.values():
            b.index_copy_(0, at[1], b.index_select(0, at[0]))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
