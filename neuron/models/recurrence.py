"""The Gated DeltaNet's per-sequence computations in plain torch: the reference for the Triton
kernels (neuron/kernels/deltanet.py), and the CPU path. Each takes the step's sequences as
``spans``: (first token row, tokens, state slot) of each.

- the causal depthwise conv over q, k and v, whose state is a sequence's last ``K - 1`` inputs;
- the gated delta rule: one ``[k_head_dim, v_head_dim]`` matrix per value head, decayed by
  ``exp(g)`` and corrected towards each new value by ``beta`` every token:
  ``S = S * exp(g_t);  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t`` (q and k
  L2-normed, q scaled by ``1/sqrt(k_head_dim)``; the key heads serve ``r`` value heads each),
  a decode token by the recurrence, more tokens in chunks;
- the gated RMS norm of its output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Spans = list[tuple[int, int, int]]
# Snapshots of the state: (span index, the span's tokens before the point, slot that takes it).
Snapshots = list[tuple[int, int, int]]
CHUNK = 64


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                spans: Spans, snapshots: Snapshots = ()) -> torch.Tensor:
    """silu(conv) of each span's rows of ``x`` [T, C] after the inputs its conv state [slots, C,
    K - 1] remembers, which then remembers the last ``K - 1`` of them all; float32 [T, C]."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    K = weight.shape[1]
    for i, at, dst in snapshots:
        row, _, slot = spans[i]
        state[dst] = torch.cat([state[slot].float(), x[row: row + at].t().float()], dim=1)[:, -(K - 1):]
    for row, n, slot in spans:
        seq = torch.cat([state[slot].float(), x[row: row + n].t().float()], dim=1)  # [C, K - 1 + n]
        state[slot] = seq[:, n:]
        y = (seq.unfold(1, K, 1) * weight[:, None, :]).sum(-1)  # [C, n]
        if bias is not None:
            y = y + bias[:, None]
        out[row: row + n] = F.silu(y).t()
    return out


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor, spans: Spans, r: int, snapshots: Snapshots = ()) -> torch.Tensor:
    """The gated delta rule over each span's rows from and back into its ``state`` [slots, nv,
    hk, hv] slot. ``qkv`` [T, 2 nk hk + nv hv] after the conv; float32 [T, nv * hv]."""
    T = qkv.shape[0]
    _, nv, hk, hv = state.shape
    nk = nv // r
    q, k, v = qkv.float().split([nk * hk, nk * hk, nv * hv], dim=-1)
    q = (l2norm(q.reshape(T, nk, hk)) * hk ** -0.5).repeat_interleave(r, dim=1)
    k = l2norm(k.reshape(T, nk, hk)).repeat_interleave(r, dim=1)
    v = v.reshape(T, nv, hv)
    beta = torch.sigmoid(b.float())
    g = neg_a * F.softplus(a.float() + dt_bias)
    out = torch.empty(T, nv, hv, dtype=torch.float32, device=qkv.device)
    for i, (first, n, slot) in enumerate(spans):
        S = state[slot].float()
        cuts = sorted((at, dst) for j, at, dst in snapshots if j == i and at < n) + [(n, -1)]
        done = 0
        for at, dst in cuts:
            row, m = first + done, at - done
            rows = slice(row, row + m)
            if m == 1:
                o, S = recurrent_step(q[row], k[row], v[row], g[row], beta[row], S)
                out[row] = o
            elif m:
                out[rows], S = chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], S)
            if dst >= 0:
                state[dst] = S
            done = at
        state[slot] = S
        for j, at, dst in snapshots:  # a snapshot after the span's last token is its state
            if j == i and at == n:
                state[dst] = S
    return out.view(T, nv * hv)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(o per head of ``weight``'s size) * silu(z), in z's dtype."""
    T, width = z.shape
    hv = weight.shape[0]
    h = o.view(T, width // hv, hv).to(z.dtype).float()
    normed = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(z.dtype)
    return (normed * F.silu(z.float()).to(z.dtype).view(T, width // hv, hv)).view(T, width)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: ``q``, ``k`` [nv, hk], ``v`` [nv, hv], ``g``, ``beta`` [nv], ``S`` [nv, hk, hv]."""
    S = S * g.exp()[:, None, None]
    kv = (S * k[:, :, None]).sum(1)
    S = S + k[:, :, None] * ((v - kv) * beta[:, None])[:, None, :]
    return (S * q[:, :, None]).sum(1), S


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
