"""The Gated DeltaNet layer of the hybrid family (Qwen3-Next, Qwen3.5): linear attention whose
state per sequence is fixed in size, so it keeps no K/V but a ``RecurrentState``:

- the conv state: the last ``K - 1`` inputs of a short causal depthwise conv over q, k and v
  (``[conv_dim, K - 1]``);
- the delta-rule state: one ``[k_head_dim, v_head_dim]`` matrix per value head, decayed by
  ``exp(g)`` and corrected towards each new value by ``beta`` every token:
  ``S = S * exp(g_t);  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t`` (q and k
  L2-normed, q scaled by ``1/sqrt(k_head_dim)``; the key heads serve ``r`` value heads each).

The output is RMS-normed per head, gated by ``silu(z)`` and projected back. Both checkpoint
layouts are read into one: Qwen3.5's ``in_proj_qkv / in_proj_z / in_proj_b / in_proj_a``, and
Qwen3-Next's ``in_proj_qkvz / in_proj_ba``, whose rows are grouped by key head (q, k, v, z of a
group, then b, a of a group): their rows are picked apart at load. The state is float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from protocol import ModelConfig

from .interface import RecurrentState
from .layers import WeightSource
from .ops import rms_norm
from .tp_linear import column_parallel


class DeltaNetShape:
    def __init__(self, cfg: ModelConfig) -> None:
        x = cfg.extra
        self.nk, self.nv = int(x["linear_num_key_heads"]), int(x["linear_num_value_heads"])
        self.hk, self.hv = int(x["linear_key_head_dim"]), int(x["linear_value_head_dim"])
        self.kernel = int(x["linear_conv_kernel_dim"])
        self.r = self.nv // self.nk  # value heads per key head
        self.key_dim, self.value_dim = self.nk * self.hk, self.nv * self.hv
        self.conv_dim = 2 * self.key_dim + self.value_dim

    def state(self) -> RecurrentState:
        return RecurrentState(((self.conv_dim, self.kernel - 1), (self.nv, self.hk, self.hv)), torch.float32)


def _rows(start: int, n: int) -> range:
    return range(start, start + n)


class GatedDeltaNet:
    def __init__(self, cfg: ModelConfig, src: WeightSource, prefix: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        s = self.shape = DeltaNetShape(cfg)
        self.eps = cfg.rms_norm_eps

        def linear(parts: list[tuple[str, range | None]]):
            return column_parallel(src, parts, dtype=dtype, device=device)

        if src.has(f"{prefix}.in_proj_qkvz.weight"):  # Qwen3-Next: rows grouped by key head
            qkvz, ba = f"{prefix}.in_proj_qkvz.weight", f"{prefix}.in_proj_ba.weight"
            group = 2 * s.hk + 2 * s.r * s.hv
            offsets = {"q": (0, s.hk), "k": (s.hk, s.hk), "v": (2 * s.hk, s.r * s.hv), "z": (2 * s.hk + s.r * s.hv, s.r * s.hv)}

            def picked(part: str) -> list[tuple[str, range]]:
                at, n = offsets[part]
                return [(qkvz, _rows(g * group + at, n)) for g in range(s.nk)]

            self.qkv = linear(picked("q") + picked("k") + picked("v"))
            self.z = linear(picked("z"))
            self.b = linear([(ba, _rows(g * 2 * s.r, s.r)) for g in range(s.nk)])
            self.a = linear([(ba, _rows(g * 2 * s.r + s.r, s.r)) for g in range(s.nk)])
        else:  # Qwen3.5
            self.qkv = linear([(f"{prefix}.in_proj_qkv.weight", None)])
            self.z = linear([(f"{prefix}.in_proj_z.weight", None)])
            self.b = linear([(f"{prefix}.in_proj_b.weight", None)])
            self.a = linear([(f"{prefix}.in_proj_a.weight", None)])
        self.conv = src.get(f"{prefix}.conv1d.weight").reshape(s.conv_dim, s.kernel).to(device, torch.float32)
        self.conv_bias = (src.get(f"{prefix}.conv1d.bias").to(device, torch.float32)
                          if src.has(f"{prefix}.conv1d.bias") else None)
        self.neg_a = -src.get(f"{prefix}.A_log").float().exp().to(device)
        self.dt_bias = src.get(f"{prefix}.dt_bias").float().to(device)
        self.norm = src.get(f"{prefix}.norm.weight").to(device, dtype)
        self.out = column_parallel(src, [(f"{prefix}.out_proj.weight", None)], dtype=dtype, device=device)

    def linears(self) -> list:
        return [self.qkv, self.z, self.b, self.a, self.out]

    def tensors(self) -> list[torch.Tensor]:
        own = [self.conv, self.neg_a, self.dt_bias, self.norm] + ([self.conv_bias] if self.conv_bias is not None else [])
        return [t for lin in self.linears() for t in lin.tensors()] + own

    def __call__(self, x: torch.Tensor, state: list[torch.Tensor], spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """``x`` [T, hidden]; ``state``: the layer's (conv, delta-rule) tensors, [slots + 1, ...]
        each; ``spans``: (first row, tokens, state slot) of each sequence, in row order."""
        s = self.shape
        T = x.shape[0]
        mixed = self.qkv(x).float()
        beta = torch.sigmoid(self.b(x).float())
        g = self.neg_a * F.softplus(self.a(x).float() + self.dt_bias)
        conv_state, delta_state = state
        out = torch.empty(T, s.nv, s.hv, dtype=torch.float32, device=x.device)
        for row, n, slot in spans:
            rows = slice(row, row + n)
            qkv = self._conv(mixed[rows], conv_state, slot)
            q, k, v = qkv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
            q = F.normalize(q.view(n, s.nk, s.hk), dim=-1, eps=1e-6) * s.hk ** -0.5
            k = F.normalize(k.view(n, s.nk, s.hk), dim=-1, eps=1e-6)
            if s.r > 1:
                q, k = q.repeat_interleave(s.r, dim=1), k.repeat_interleave(s.r, dim=1)
            out[rows] = self._delta_rule(q, k, v.view(n, s.nv, s.hv), g[rows], beta[rows], delta_state, slot)
        z = self.z(x).view(T, s.nv, s.hv)
        o = rms_norm(out.to(x.dtype), self.norm, self.eps) * F.silu(z.float()).to(x.dtype)
        return self.out(o.reshape(T, s.value_dim))

    def _conv(self, mixed: torch.Tensor, conv_state: torch.Tensor, slot: int) -> torch.Tensor:
        """The causal depthwise conv of a sequence's new rows ``mixed`` [n, conv_dim] after the
        inputs its conv state remembers, which then remembers the last ``K - 1`` of them all."""
        n = mixed.shape[0]
        seq = torch.cat([conv_state[slot], mixed.t()], dim=1)  # [conv_dim, K - 1 + n]
        conv_state[slot] = seq[:, n:]
        windows = seq.unfold(1, self.shape.kernel, 1)  # [conv_dim, n, K]
        y = (windows * self.conv[:, None, :]).sum(-1)
        if self.conv_bias is not None:
            y = y + self.conv_bias[:, None]
        return F.silu(y).t()

    @staticmethod
    def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    states: torch.Tensor, slot: int) -> torch.Tensor:
        """One sequence's tokens through the gated delta rule, from and back into its state."""
        S = states[slot]  # [nv, hk, hv]
        out = torch.empty_like(v)
        for t in range(q.shape[0]):
            S = S * g[t].exp()[:, None, None]
            kv = (S * k[t][:, :, None]).sum(1)
            S = S + k[t][:, :, None] * ((v[t] - kv) * beta[t][:, None])[:, None, :]
            out[t] = (S * q[t][:, :, None]).sum(1)
        states[slot] = S
        return out
