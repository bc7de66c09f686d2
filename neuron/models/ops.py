"""The model's small element-wise ops, in plain torch: the reference, and the CPU path.

A rank's runner may swap in fused kernels with the same signatures (see neuron/runner/ops.py);
the model code calls only these names, so how an op runs is decided outside the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import recurrence


@dataclass(frozen=True)
class RopeTables:
    cos: torch.Tensor  # [max_len, head_dim], the halves repeated (neox "rotate half" layout)
    sin: torch.Tensor


@dataclass(frozen=True)
class StateSpans:
    """A step's sequences as its recurrent layers see them: (first token row, tokens, state slot)
    of each, on the host (``spans``; empty inside a CUDA graph) and as an int64 device table
    (``table``: those three as rows, and where the step runs the delta rule in chunks, each
    sequence's first chunk and chunk count in ``chunks``; the Triton kernels read them), and a
    bound on their tokens (``max_n``: it fixes a kernel's grid, so a graph's is its bucket's).
    ``snapshots``: (sequence index, its tokens before the point, slot) of each state snapshot the
    step takes; ``chunks`` [3, C] (first row, tokens, snapshot slot or -1) and ``conv_snaps`` [4,
    M] say the same to the kernels (``neuron.kernels.deltanet``). No ``chunks``: token after token."""

    spans: list[tuple[int, int, int]]
    table: torch.Tensor | None
    max_n: int
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    chunks: torch.Tensor | None = None
    conv_snaps: torch.Tensor | None = None


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

    def reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            comm, peers=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm`` of x summed over the tensor-parallel ranks (``comm``, a
        ``layers.Collectives``; ``peers``: its ``PeerRows`` where they are not set yet)."""
        return self.add_rms_norm(comm.all_reduce(x), residual, weight, eps)

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

    # The Gated DeltaNet's (recurrence.py says what each computes).
    def causal_conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                    spans: StateSpans) -> torch.Tensor:
        return recurrence.causal_conv(x, weight, bias, state, spans.spans, spans.snapshots)

    def delta_rule(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor,
                   dt_bias: torch.Tensor, state: torch.Tensor, spans: StateSpans, r: int) -> torch.Tensor:
        return recurrence.delta_rule(qkv, a, b, neg_a, dt_bias, state, spans.spans, r, spans.snapshots)

    def gated_rms_norm(self, o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return recurrence.gated_rms_norm(o, z, weight, eps)
