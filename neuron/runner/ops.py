"""The model's small ops as fused Triton kernels (CUDA), with the torch reference as the fallback
for shapes a kernel does not take."""

from __future__ import annotations

import torch

from neuron.models.ops import TorchOps

from . import kernels


class TritonOps(TorchOps):
    def __init__(self, fallback: TorchOps) -> None:
        self.fallback = fallback

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1:
            return self.fallback.rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps)[0]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new residual stream into ``residual`` (the model owns it)."""
        if x.dim() != 2 or x.stride(1) != 1 or residual.stride() != x.stride():
            return self.fallback.add_rms_norm(x, residual, weight, eps)
        out, residual = kernels.rms_norm(x, weight, eps, residual)
        return out, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(1) != 1:
            return self.fallback.silu_mul(gate_up)
        return kernels.silu_mul(gate_up)
