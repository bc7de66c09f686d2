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
from .sharding import split_even
from .tp_linear import column_parallel, row_parallel


def key_heads(cfg: ModelConfig, world: int, rank: int) -> range:
    """The rank's linear-attention key heads (each with its ``r`` value heads): whole heads, as
    evenly as they go."""
    return split_even(int(cfg.extra["linear_num_key_heads"]), world, rank)


class DeltaNetShape:
    """The sizes of one rank's share of a Gated DeltaNet layer (key heads ``heads``; all of them
    when None)."""

    def __init__(self, cfg: ModelConfig, heads: range | None = None) -> None:
        x = cfg.extra
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
        return RecurrentState(((self.conv_dim, self.kernel - 1), (self.nv, self.hk, self.hv)), torch.float32)


def _rows(start: int, n: int) -> range:
    return range(start, start + n)


class GatedDeltaNet:
    """One rank's share of the layer: its key heads with their value heads. The projections in are
    column-parallel, the conv and the delta rule run per head, ``out_proj`` is row-parallel (the
    caller all-reduces)."""

    def __init__(self, cfg: ModelConfig, src: WeightSource, prefix: str, dtype: torch.dtype, device: torch.device,
                 heads: range | None = None) -> None:
        s = self.shape = DeltaNetShape(cfg, heads)
        self.eps = cfg.rms_norm_eps
        values = range(s.values.start * s.hv, s.values.stop * s.hv)

        def linear(parts: list[tuple[str, range | None]]):
            return column_parallel(src, parts, dtype=dtype, device=device)

        if src.has(f"{prefix}.in_proj_qkvz.weight"):  # Qwen3-Next: rows grouped by key head
            qkvz, ba = f"{prefix}.in_proj_qkvz.weight", f"{prefix}.in_proj_ba.weight"
            group = 2 * s.hk + 2 * s.r * s.hv
            offsets = {"q": (0, s.hk), "k": (s.hk, s.hk), "v": (2 * s.hk, s.r * s.hv),
                       "z": (2 * s.hk + s.r * s.hv, s.r * s.hv)}

            def picked(part: str) -> list[tuple[str, range]]:
                at, n = offsets[part]
                return [(qkvz, _rows(g * group + at, n)) for g in s.heads]

            self.qkv = linear(picked("q") + picked("k") + picked("v"))
            self.z = linear(picked("z"))
            self.b = linear([(ba, _rows(g * 2 * s.r, s.r)) for g in s.heads])
            self.a = linear([(ba, _rows(g * 2 * s.r + s.r, s.r)) for g in s.heads])
        else:  # Qwen3.5
            self.qkv = linear([(f"{prefix}.in_proj_qkv.weight", part) for part in s.channels()])
            self.z = linear([(f"{prefix}.in_proj_z.weight", values)])
            self.b = linear([(f"{prefix}.in_proj_b.weight", s.values)])
            self.a = linear([(f"{prefix}.in_proj_a.weight", s.values)])
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
        return [self.qkv, self.z, self.b, self.a, self.out]

    def tensors(self) -> list[torch.Tensor]:
        own = [self.conv, self.neg_a, self.dt_bias, self.norm]
        own += [self.conv_bias] if self.conv_bias is not None else []
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
        """One sequence's tokens through the gated delta rule, from and back into its state: a
        decode token by the recurrence, more tokens in chunks."""
        if q.shape[0] == 1:
            out, states[slot] = recurrent_step(q[0], k[0], v[0], g[0], beta[0], states[slot])
            return out[None]
        out, states[slot] = chunked(q, k, v, g, beta, states[slot])
        return out


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: ``q``, ``k`` [nv, hk], ``v`` [nv, hv], ``g``, ``beta`` [nv], ``S`` [nv, hk, hv]."""
    S = S * g.exp()[:, None, None]
    kv = (S * k[:, :, None]).sum(1)
    S = S + k[:, :, None] * ((v - kv) * beta[:, None])[:, None, :]
    return (S * q[:, :, None]).sum(1), S


CHUNK = 64


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same over ``n`` tokens (``q``, ``k`` [n, nv, hk], ``v`` [n, nv, hv], ``g``, ``beta``
    [n, nv]) in chunks of ``CHUNK``: within a chunk the updates are solved at once (the WY form of
    the delta rule: a unit lower-triangular system of the chunk's keys), across chunks the state
    carries on. Padding tokens (beta 0, no decay) change nothing."""
    n, nv = q.shape[:2]
    pad = (-n) % CHUNK
    chunks = (n + pad) // CHUNK

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [n, nv, d] -> [nv, chunks, CHUNK, d]
        return F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(nv, chunks, CHUNK, -1)

    q, k, v = blocks(q), blocks(k), blocks(v)
    g, beta = (F.pad(x, (0, 0, 0, pad)).t().reshape(nv, chunks, CHUNK) for x in (g, beta))
    cum = g.cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    carry = cum[..., -1].exp()
    out = torch.empty_like(u)
    for i in range(chunks):
        new = u[:, i] - w[:, i] @ S
        out[:, i] = q[:, i] @ S + inner[:, i] @ new
        S = S * carry[:, i, None, None] + k[:, i].transpose(-1, -2) @ new
    return out.reshape(nv, chunks * CHUNK, -1)[:, :n].transpose(0, 1), S
