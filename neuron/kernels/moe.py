"""Sparse mixture-of-experts on a GPU without data-dependent shapes, so a CUDA graph can hold it.

- A step of few (token, expert) pairs (decodes): one program per pair and block of columns
  multiplies the pair's row by its expert's gate and up rows and writes their SiLU product, then
  one program per token and block of output columns sums its pairs' down products, weighted
  (``decode_experts``); a shared expert rides along in both. Only the chosen experts are read,
  with nothing to sort; an expert two pairs chose is read twice.
- A step of many: the pairs are sorted by expert into blocks of rows (an expert's last block
  padded), and one grouped product runs every block against its expert's weights, reading each
  chosen expert's weights once per block of its pairs (``grouped``).

Checked against the per-expert loop of neuron/models/moe.py. The tiles: scripts/bench-kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import moe_packed
from .launch import dot_precision, grid_sync, pdl_args
from .moe_packed import PackedExperts, expert_rows


PAIRS_ALONE = 128  # at most this many pairs run one program per pair (scripts/bench-kernels)
# the grouped product's tiles (rows of a block, columns, depth, warps, stages) by pair count
TILES = {"few": (16, 64, 64, 4, 3), "many": (64, 128, 64, 8, 3)}


def tiles(pairs: int) -> tuple[int, int, int, int, int]:
    return TILES["few" if pairs <= 256 else "many"]


def sort_pairs(chosen: torch.Tensor, experts: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of ``chosen`` [T, k] (expert ids) sorted by expert, each expert's padded to a
    multiple of ``rows``: the pair at each padded position ([P + E (rows - 1)] rounded up to
    ``rows``; padding holds P = T k), and each block's expert (-1: past the last block). Torch
    ops of fixed shapes, no host sync."""
    flat = chosen.reshape(-1)
    P, device = flat.numel(), flat.device
    count = torch.zeros(experts, dtype=torch.int64, device=device).index_add_(0, flat, torch.ones_like(flat))
    padded = (count + rows - 1) // rows * rows
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(count, 0) - count
    e_sorted, order = torch.sort(flat, stable=True)
    at = padded_start[e_sorted] + torch.arange(P, device=device) - start[e_sorted]
    size = -(-(P + experts * (rows - 1)) // rows) * rows
    pairs = torch.full((size,), P, dtype=torch.int64, device=device).index_copy_(0, at, order)
    ends = torch.cumsum(padded, 0)
    block_start = torch.arange(0, size, rows, device=device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_start < ends[-1], block_expert, -1)
    return pairs, block_expert


@triton.jit(do_not_specialize=["P"])  # one compile for every count of pairs
def _grouped_kernel(X, W, S, Out, Pairs, BlockExpert, stride_x, stride_we, stride_wn, stride_se, stride_o, N, K, NS,
                    P, PER_ROW: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    """Out[pair, n] = sum_k X[row, k] W[expert, n, k] for the rows of one block of pairs (program
    axis 1) and one block of N (axis 0); ``row`` is the pair's token (``PER_ROW`` pairs share a
    token) or the pair itself (PER_ROW 1). W dense, or with ``BITS`` its packed bytes
    (``PackedExperts``, S the scale words)."""
    b = tl.program_id(1)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    grid_sync(PDL)
    expert = tl.load(BlockExpert + b)
    if expert >= 0:
        pair = tl.load(Pairs + b * BM + tl.arange(0, BM))
        valid = pair < P
        row = pair // PER_ROW
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            a = tl.load(X + row[:, None] * stride_x + k[None, :], mask=valid[:, None] & (k < K)[None, :], other=0.0)
            if BITS:
                wt = expert_rows(W, S, expert, n, k0, N, K, NS, stride_we, stride_wn, stride_se, BITS, GS, BK)
                bt = tl.trans(wt.to(a.dtype))
            else:
                bt = tl.load(W + expert * stride_we + n[None, :] * stride_wn + k[:, None],
                             mask=(k < K)[:, None] & (n < N)[None, :], other=0.0)
            acc += tl.dot(a, bt, input_precision=PREC)
        tl.store(Out + pair[:, None] * stride_o + n[None, :], acc.to(Out.dtype.element_ty),
                 mask=valid[:, None] & (n < N)[None, :])


PACKED_TILES = (128, 64, 4, 2)  # the grouped product's (columns, depth, warps, stages) on packed W


def grouped(x: torch.Tensor, w: torch.Tensor | PackedExperts, pairs: torch.Tensor, block_expert: torch.Tensor,
            P: int, per_row: int) -> torch.Tensor:
    """[P, N]: each pair's row of ``x`` (its token's: row ``pair // per_row``) times its expert's
    ``w`` [E, N, K] (dense, or ``PackedExperts``)."""
    E, N, K = w.shape
    out = torch.empty(P, N, dtype=x.dtype, device=x.device)
    rows, BN, BK, warps, stages = tiles(P)
    if isinstance(w, PackedExperts):
        BN, BK, warps, stages = PACKED_TILES
        W, S, bits = w.u, w.words(), w.bits
        NS, stride_s = S.shape[2], S.stride(0)
    else:
        W, S, bits, NS, stride_s = w, w, 0, 1, 0
    # A block's column tiles run side by side, so its gathered rows are read from HBM once, not
    # once per tile (H200, 35B-A3B shape: 8 tiles of 128 columns re-read 134 MB of rows a layer).
    _grouped_kernel[(triton.cdiv(N, BN), block_expert.numel())](
        x, W, S, out, pairs, block_expert, x.stride(0), W.stride(0), W.stride(1), stride_s, out.stride(0), N, K, NS, P,
        PER_ROW=per_row, BITS=bits, GS=K // NS if bits else 0, BM=rows, BN=BN, BK=BK, PREC=dot_precision(x.dtype),
        num_warps=warps, num_stages=stages, **pdl_args(x.device))
    return out


@triton.jit
def _silu_rows(w, x, n, nm, K, stride_wn, up, BK: tl.constexpr):
    """silu(W[n] . x) * (W[up + n] . x) in float32 for the rows ``n`` of a gate/up pair."""
    g = tl.zeros((n.shape[0], BK), dtype=tl.float32)
    u = tl.zeros((n.shape[0], BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        m = nm[:, None] & (k < K)[None, :]
        xk = tl.load(x + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
        g += tl.load(w + n[:, None] * stride_wn + k[None, :], mask=m, other=0.0).to(tl.float32) * xk
        u += tl.load(w + (up + n)[:, None] * stride_wn + k[None, :], mask=m, other=0.0).to(tl.float32) * xk
    gs, us = tl.sum(g, 1), tl.sum(u, 1)
    return gs * tl.sigmoid(gs) * us


@triton.jit(do_not_specialize=["PK"])
def _gate_up_kernel(X, W, H, Chosen, SW, HS, stride_x, stride_we, stride_wn, stride_h, stride_sw, stride_hs, I, IS,
                    K, first, E, PK, PER_ROW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """H[p, n] = silu(g) * u of pair ``p``'s row (its token's, ``p // PER_ROW``) and its expert's
    gate rows ``n`` and up rows ``I + n`` of W [E, 2I, K] (nothing for a pair whose expert is not
    among the ``E`` held here); the programs past the ``PK`` pairs do the same for each token and
    the shared expert's SW [2 IS, K] into HS."""
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    grid_sync(PDL)
    if p < PK:
        e = tl.load(Chosen + p) - first
        if (e >= 0) & (e < E) & (tl.program_id(1) * BN < I):
            h = _silu_rows(W + e * stride_we, X + (p // PER_ROW) * stride_x, n, n < I, K, stride_wn, I, BK)
            tl.store(H + p * stride_h + n, h.to(H.dtype.element_ty), mask=n < I)
    elif tl.program_id(1) * BN < IS:
        t = p - PK
        h = _silu_rows(SW, X + t * stride_x, n, n < IS, K, stride_sw, IS, BK)
        tl.store(HS + t * stride_hs + n, h.to(HS.dtype.element_ty), mask=n < IS)


@triton.jit
def _weighted_down_kernel(H, W, Out, Chosen, Weights, HS, SD, stride_h, stride_we, stride_wn, stride_o, stride_w,
                          stride_hs, stride_sd, N, K, KS, first, E, TOPK: tl.constexpr, SHARED: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, PDL: tl.constexpr):
    """Out[t, n] = sum_j Weights[t, j] (W[Chosen[t, j] - first, n] . H[t TOPK + j]) over the
    token's choices whose expert is among the ``E`` held here (the others' rows of H are never
    read: their gate/up products were not written), plus ``Weights[t, TOPK] (SD[n] . HS[t])``
    for the shared expert when ``SHARED``. Every (choice, block of K) unrolled (``KB`` blocks),
    each block of H scaled by its weight: no load waits on an earlier choice's expert id, so
    the loads of all the choices are in flight together."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    grid_sync(PDL)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(Chosen + t * TOPK + j) - first
        held = (e >= 0) & (e < E)
        e = tl.where(held, e, 0)
        weight = tl.load(Weights + t * stride_w + j).to(tl.float32)
        for b in tl.static_range(KB):
            k = b * BK + tl.arange(0, BK)
            km = k < tl.where(held, K, 0)  # a choice held elsewhere reads nothing
            h = tl.load(H + (t * TOPK + j) * stride_h + k, mask=km, other=0.0).to(tl.float32) * weight
            wt = tl.load(W + e * stride_we + n[:, None] * stride_wn + k[None, :], mask=nm[:, None] & km[None, :],
                         other=0.0)
            acc += wt.to(tl.float32) * h[None, :]
    if SHARED:
        scale = tl.load(Weights + t * stride_w + TOPK).to(tl.float32)
        for k0 in range(0, KS, BK):
            k = k0 + tl.arange(0, BK)
            km = k < KS
            h = tl.load(HS + t * stride_hs + k, mask=km, other=0.0).to(tl.float32) * scale
            wt = tl.load(SD + n[:, None] * stride_sd + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += wt.to(tl.float32) * h[None, :]
    tl.store(Out + t * stride_o + n, tl.sum(acc, 1).to(Out.dtype.element_ty), mask=nm)


# the decode kernels' (block of rows, block of K, warps, stages): scripts/bench-kernels
DECODE = {"gate_up": (8, 256, 4, 3), "down": (8, 512, 4, 2)}


def decode_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, first: int, gate_up: torch.Tensor,
                   down: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """[T, H]: each token's chosen experts (``chosen`` [T, k]; those among the ``E`` of
    ``gate_up`` [E, 2I, H] and ``down`` [E, H, I], experts ``first ..``) and the ``shared``
    expert's (gate/up [2 IS, H], down [H, IS]) SiLU MLPs of its row of ``x``, weighted by
    ``weights`` [T, k (+ 1 for the shared)] and summed in float32: two launches, a program per
    pair and block of columns, only the chosen experts read."""
    T, k = chosen.shape
    E, I2, K = gate_up.shape
    flat = chosen.reshape(-1).contiguous()
    sgu, sd = shared if shared is not None else (gate_up[0, :0], down[0, :, :0])
    IS = sgu.shape[0] // 2
    h = torch.empty(T * k, I2 // 2, dtype=x.dtype, device=x.device)
    hs = torch.empty(T, IS, dtype=x.dtype, device=x.device)
    BN, BK, warps, stages = DECODE["gate_up"]
    _gate_up_kernel[(T * k + (T if shared is not None else 0), triton.cdiv(max(I2 // 2, IS), BN))](
        x, gate_up, h, flat, sgu, hs, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        max(sgu.stride(0), 1), hs.stride(0), I2 // 2, IS, K, first, E, T * k, PER_ROW=k, BN=BN, BK=BK,
        num_warps=warps, num_stages=stages, **pdl_args(x.device))
    N = down.shape[1]
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    BN, BK, warps, stages = DECODE["down"]
    _weighted_down_kernel[(T, triton.cdiv(N, BN))](
        h, down, out, flat, weights, hs, sd, h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        weights.stride(0), hs.stride(0), max(sd.stride(0), 1), N, down.shape[2], IS, first, E, TOPK=k,
        SHARED=shared is not None, BN=BN, BK=BK, KB=triton.cdiv(down.shape[2], BK), num_warps=warps,
        num_stages=stages, **pdl_args(x.device))
    return out


@triton.jit
def _route_kernel(Logits, Weights, Chosen, stride_l, stride_w, E, TOPK: tl.constexpr, K_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr):
    """A token's router: the softmax of its first ``E`` logits in float32, its ``TOPK`` largest
    probabilities (largest first; of equals, the lowest expert), renormalised to sum to 1 when
    ``NORM``, written in ``Weights``' dtype with their experts; when ``SHARED``, the sigmoid of
    logit ``E`` (the shared expert's gate) after them."""
    t = tl.program_id(0)
    i = tl.arange(0, E_PAD)
    m = i < E
    grid_sync(PDL)
    logit = tl.load(Logits + t * stride_l + i, mask=m, other=-float("inf")).to(tl.float32)
    p = tl.where(m, tl.exp(logit - tl.max(logit, 0)), 0.0)
    p = p / tl.sum(p, 0)
    left = tl.where(m, p, -1.0)
    slot = tl.arange(0, K_PAD)
    vals = tl.zeros((K_PAD,), dtype=tl.float32)
    idxs = tl.zeros((K_PAD,), dtype=tl.int64)
    for j in tl.static_range(TOPK):
        best = tl.max(left, 0)
        at = tl.min(tl.where(left == best, i, E_PAD), 0)
        vals = tl.where(slot == j, best, vals)
        idxs = tl.where(slot == j, at.to(tl.int64), idxs)
        left = tl.where(i == at, -2.0, left)
    if NORM:
        vals = vals / tl.sum(vals, 0)
    tl.store(Weights + t * stride_w + slot, vals.to(Weights.dtype.element_ty), mask=slot < TOPK)
    tl.store(Chosen + t * TOPK + slot, idxs, mask=slot < TOPK)
    if SHARED:
        gate = tl.sigmoid(tl.load(Logits + t * stride_l + E).to(tl.float32))
        tl.store(Weights + t * stride_w + TOPK, gate.to(Weights.dtype.element_ty))


def route(logits: torch.Tensor, k: int, norm: bool, dtype: torch.dtype,
          experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``topk(softmax(logits[:, :experts], float32), k)`` (renormalised when ``norm``), the
    weights in ``dtype``: one launch in place of five. A column past the ``experts`` is the shared
    expert's gate: its sigmoid becomes the weights' column ``k``."""
    T, cols = logits.shape
    E = cols if experts is None else experts
    assert cols in (E, E + 1) and logits.stride(1) == 1
    weights = torch.empty(T, k + cols - E, dtype=dtype, device=logits.device)
    chosen = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    _route_kernel[(T,)](logits, weights, chosen, logits.stride(0), weights.stride(0), E, TOPK=k,
                        K_PAD=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(E), NORM=norm,
                        SHARED=cols > E, num_warps=4 if E >= 512 else 1, **pdl_args(logits.device))
    return weights, chosen


def sparse_moe(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, first: int,
               gate_up: torch.Tensor | PackedExperts, down: torch.Tensor | PackedExperts, silu_mul,
               shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu_mul(gate_up_e(x_t))) over each token's chosen experts
    ``chosen`` [T, k] that this rank holds: ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] (dense,
    or both ``PackedExperts``) are experts ``first .. first + E`` (a pair routed elsewhere adds
    nothing here); ``silu_mul`` the step's fused SiLU·mul. With a ``shared`` expert (its gate/up
    and down, dense), plus its MLP weighted by ``weights[:, k]``."""
    T, k = chosen.shape
    E = gate_up.shape[0]
    weights = weights.contiguous()
    packed = isinstance(gate_up, PackedExperts)
    if T * k <= PAIRS_ALONE:
        if packed:
            return _plus_shared(moe_packed.decode_experts(x, weights, chosen, first, gate_up, down), x, weights, k,
                                shared, silu_mul)
        return decode_experts(x, weights, chosen, first, gate_up, down, shared)
    local = chosen - first
    here = (local >= 0) & (local < E)
    pairs, block_expert = sort_pairs(torch.where(here, local, E), E + 1, tiles(T * k)[0])  # E: elsewhere
    block_expert = torch.where(block_expert == E, -1, block_expert)
    h = silu_mul(grouped(x, gate_up, pairs, block_expert, T * k, k))
    y = grouped(h, down, pairs, block_expert, T * k, 1)
    extra = None if shared is None else F.linear(silu_mul(F.linear(x, shared[0])), shared[1])
    return combine(y, chosen, weights, first, E, extra)


@triton.jit
def _combine_kernel(Y, Chosen, Weights, Extra, Out, stride_y, stride_w, stride_e, stride_o, N, first, E,
                    TOPK: tl.constexpr, EXTRA: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    """Out[t, n] = sum_j Weights[t, j] Y[t TOPK + j, n] over the token's choices held here (the
    rows of the others were never written), plus Weights[t, TOPK] Extra[t, n] when ``EXTRA``; in
    float32, rounded once."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    grid_sync(PDL)
    acc = tl.zeros((BN,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(Chosen + t * TOPK + j) - first
        held = (e >= 0) & (e < E)
        y = tl.load(Y + (t * TOPK + j) * stride_y + n, mask=n < tl.where(held, N, 0), other=0.0)
        acc += y.to(tl.float32) * tl.load(Weights + t * stride_w + j).to(tl.float32)
    if EXTRA:
        acc += tl.load(Extra + t * stride_e + n, mask=nm, other=0.0).to(tl.float32) * \
            tl.load(Weights + t * stride_w + TOPK).to(tl.float32)
    tl.store(Out + t * stride_o + n, acc.to(Out.dtype.element_ty), mask=nm)


def combine(y: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, first: int, experts: int,
            extra: torch.Tensor | None) -> torch.Tensor:
    """[T, N]: each token's rows of ``y`` [T k, N] (its pairs' expert outputs; ``chosen`` [T, k]
    names their experts, those outside ``first .. first + experts`` count nothing) weighted by
    ``weights`` [T, k (+ 1)] and summed, plus ``extra`` [T, N] (a shared expert's output)
    weighted by ``weights[:, k]``: one pass over ``y`` in place of four."""
    T, k = chosen.shape
    N = y.shape[1]
    out = torch.empty(T, N, dtype=y.dtype, device=y.device)
    flat = chosen.reshape(-1).contiguous()
    e = y if extra is None else extra
    BN = min(1024, triton.next_power_of_2(N))
    _combine_kernel[(T, triton.cdiv(N, BN))](y, flat, weights, e, out, y.stride(0), weights.stride(0), e.stride(0),
                                              out.stride(0), N, first, experts, TOPK=k, EXTRA=extra is not None, BN=BN,
                                              num_warps=4, **pdl_args(y.device))
    return out


def _plus_shared(out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, k: int,
                 shared: tuple[torch.Tensor, torch.Tensor] | None, silu_mul) -> torch.Tensor:
    """``out`` plus the ``shared`` expert's MLP of ``x`` weighted by ``weights[:, k]``, if any."""
    if shared is None:
        return out
    return out + weights[:, k:] * F.linear(silu_mul(F.linear(x, shared[0])), shared[1])
