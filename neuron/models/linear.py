"""The linear layers of a shard: ``y = x W^T + b`` over this rank's share of a weight.

Every projection of a model goes through a ``Linear``, so how a weight is stored (dense today,
packed quantized formats beside it) is decided here and nowhere else in the model code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
