"""The Gated DeltaNet layer of the hybrid family (Qwen3-Next, Qwen3.5): linear attention whose
state per sequence is fixed in size, so it keeps no K/V but a ``RecurrentState``: the conv state
(the last ``K - 1`` inputs of a short causal depthwise conv over q, k and v, ``[conv_dim, K - 1]``,
in the activation dtype, which holds them exactly) and the delta-rule state (one ``[k_head_dim,
v_head_dim]`` matrix per value head, float32 unless configured otherwise). ``recurrence`` says
what each part computes; the model's ops run them (torch, or the Triton kernels on a GPU).

The output is RMS-normed per head, gated by ``silu(z)`` and projected back. Both checkpoint
layouts are read into one projection in (q, k, v, z, b, a stacked): Qwen3.5's ``in_proj_qkv /
in_proj_z / in_proj_b / in_proj_a``, and Qwen3-Next's ``in_proj_qkvz / in_proj_ba``, whose rows are
grouped by key head (q, k, v, z of a group, then b, a of a group): their rows are picked apart at
load.
"""

from __future__ import annotations

import torch

from protocol import ModelConfig

from .interface import RecurrentState
from .layers import WeightSource
from .ops import StateSpans, TorchOps
from .sharding import split_even
from .tp_linear import column_parallel, row_parallel


def key_heads(cfg: ModelConfig, world: int, rank: int) -> range:
    """The rank's linear-attention key heads (each with its ``r`` value heads): whole heads, as
    evenly as they go."""
    return split_even(int(cfg.extra["linear_num_key_heads"]), world, rank)


class DeltaNetShape:
    """The sizes of one rank's share of a Gated DeltaNet layer (key heads ``heads``; all of them
    when None)."""

    def __init__(self, cfg: ModelConfig, heads: range | None = None, conv_dtype: torch.dtype = torch.float32) -> None:
        x = cfg.extra
        self.conv_dtype = conv_dtype
        nk, nv = int(x["linear_num_key_heads"]), int(x["linear_num_value_heads"])
        self.hk, self.hv = int(x["linear_key_head_dim"]), int(x["linear_value_head_dim"])
        self.kernel = int(x["linear_conv_kernel_dim"])
        self.r = nv // nk  # value heads per key head
        self.heads = heads if heads is not None else range(nk)
        self.values = range(self.heads.start * self.r, self.heads.stop * self.r)
        self.nk, self.nv = len(self.heads), len(self.values)
        self.key_dim, self.value_dim = self.nk * self.hk, self.nv * self.hv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.full_key_dim = nk * self.hk  # the checkpoint's, for picking this rank's rows

    def channels(self) -> list[range]:
        """This rank's rows of the checkpoint's q, k, v (conv channels, in_proj_qkv rows)."""
        h, v = self.heads, self.values
        return [range(h.start * self.hk, h.stop * self.hk),
                range(self.full_key_dim + h.start * self.hk, self.full_key_dim + h.stop * self.hk),
                range(2 * self.full_key_dim + v.start * self.hv, 2 * self.full_key_dim + v.stop * self.hv)]

    def state(self) -> RecurrentState:
        return RecurrentState(((self.conv_dim, self.kernel - 1), (self.nv, self.hk, self.hv)),
                              dtypes=(self.conv_dtype, None))


def _rows(start: int, n: int) -> range:
    return range(start, start + n)


class GatedDeltaNet:
    """One rank's share of the layer: its key heads with their value heads. The projection in is
    column-parallel, the conv and the delta rule run per head, ``out_proj`` is row-parallel (the
    caller all-reduces)."""

    def __init__(self, cfg: ModelConfig, src: WeightSource, prefix: str, dtype: torch.dtype, device: torch.device,
                 heads: range | None = None) -> None:
        s = self.shape = DeltaNetShape(cfg, heads, dtype)
        self.eps = cfg.rms_norm_eps
        values = range(s.values.start * s.hv, s.values.stop * s.hv)
        if src.has(f"{prefix}.in_proj_qkvz.weight"):  # Qwen3-Next: rows grouped by key head
            qkvz, ba = f"{prefix}.in_proj_qkvz.weight", f"{prefix}.in_proj_ba.weight"
            group = 2 * s.hk + 2 * s.r * s.hv
            offsets = {"q": (0, s.hk), "k": (s.hk, s.hk), "v": (2 * s.hk, s.r * s.hv),
                       "z": (2 * s.hk + s.r * s.hv, s.r * s.hv)}

            def picked(part: str) -> list[tuple[str, range | None]]:
                at, n = offsets[part]
                return [(qkvz, _rows(g * group + at, n)) for g in s.heads]

            rows = picked("q") + picked("k") + picked("v") + picked("z")
            rows += [(ba, _rows(g * 2 * s.r, s.r)) for g in s.heads]
            rows += [(ba, _rows(g * 2 * s.r + s.r, s.r)) for g in s.heads]
        else:  # Qwen3.5
            rows = [(f"{prefix}.in_proj_qkv.weight", part) for part in s.channels()]
            rows += [(f"{prefix}.in_proj_z.weight", values), (f"{prefix}.in_proj_b.weight", s.values),
                     (f"{prefix}.in_proj_a.weight", s.values)]
        self.in_proj = column_parallel(src, rows, dtype=dtype, device=device)
        conv = src.get(f"{prefix}.conv1d.weight").float()
        conv = conv.reshape(conv.shape[0], s.kernel)
        self.conv = torch.cat([conv[part.start: part.stop] for part in s.channels()]).to(device)
        self.conv_bias = (torch.cat([src.get(f"{prefix}.conv1d.bias").float()[p.start: p.stop] for p in s.channels()])
                          .to(device) if src.has(f"{prefix}.conv1d.bias") else None)
        self.neg_a = -src.get(f"{prefix}.A_log").float()[s.values.start: s.values.stop].exp().to(device)
        self.dt_bias = src.get(f"{prefix}.dt_bias").float()[s.values.start: s.values.stop].to(device)
        self.norm = src.get(f"{prefix}.norm.weight").to(device, dtype)
        self.out = row_parallel(src, [(f"{prefix}.out_proj.weight", values)], dtype=dtype, device=device)

    def linears(self) -> list:
        return [self.in_proj, self.out]

    def tensors(self) -> list[torch.Tensor]:
        own = [self.conv, self.neg_a, self.dt_bias, self.norm]
        own += [self.conv_bias] if self.conv_bias is not None else []
        return [t for lin in self.linears() for t in lin.tensors()] + own

    def __call__(self, x: torch.Tensor, state: list[torch.Tensor], spans: StateSpans, ops: TorchOps) -> torch.Tensor:
        """``x`` [T, hidden]; ``state``: the layer's (conv, delta-rule) tensors, [slots + 1, ...]
        each; ``spans``: the step's sequences."""
        s = self.shape
        mixed, z, b, a = self.in_proj(x).split([s.conv_dim, s.value_dim, s.nv, s.nv], dim=-1)
        conv_state, delta_state = state
        qkv = ops.causal_conv(mixed, self.conv, self.conv_bias, conv_state, spans)
        o = ops.delta_rule(qkv, a, b, self.neg_a, self.dt_bias, delta_state, spans, s.r)
        return self.out(ops.gated_rms_norm(o, z, self.norm, self.eps))
