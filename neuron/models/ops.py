"""The model's small element-wise ops, in plain torch: the reference, and the CPU path.

A rank's runner may swap in fused kernels with the same signatures (see neuron/runner/ops.py);
the model code calls only these names, so how an op runs is decided outside the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RopeTables:
    cos: torch.Tensor  # [max_len, head_dim], the halves repeated (neox "rotate half" layout)
    sin: torch.Tensor


@dataclass(frozen=True)
class Rotary:
    """How a layer's queries and keys are positioned: the optional per-head RMS norm (qwen3's
    q_norm/k_norm), then RoPE from ``rope``."""

    rope: RopeTables
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] (already indexed by position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class TorchOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (the new residual stream) and its norm."""
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: RopeTables,
                     q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, n_q, hd], k [T, n_kv, hd]: the optional per-head RMS norm (qwen3), then RoPE."""
        if q_norm is not None and k_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        cos, sin = rope.cos[positions], rope.sin[positions]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
