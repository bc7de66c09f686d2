"""Pipeline stages: which contiguous layers a rank's stage holds, and how the ranks of a group
of ``tensor x stages`` ranks are laid out (global rank ``stage x tensor + t``; the ranks of one
stage are a tensor-parallel group of their own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def stage_layers(num_layers: int, stages: int, index: int) -> range:
    """Stage ``index``'s layers: equal runs, the first stages one longer where they do not divide
    (the last stage also holds the LM head)."""
    if not 0 < stages <= num_layers:
        raise ValueError(f"{stages} pipeline stages for {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


@dataclass(frozen=True)
class Stage:
    index: int
    count: int
    tensor: int  # ranks per stage
    layers: range
    group: Any = None  # the torch.distributed group of this stage's ranks (None: one rank)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def root(self) -> int:
        """The global rank of this stage's tensor rank 0."""
        return self.index * self.tensor

    def peer(self, step: int, tensor_rank: int) -> int:
        """The global rank of tensor rank ``tensor_rank`` in the stage ``step`` away."""
        return (self.index + step) * self.tensor + tensor_rank

    @property
    def sampler(self) -> int:
        """The rank that samples: tensor rank 0 of the last stage."""
        return (self.count - 1) * self.tensor
