"""Sparse mixture-of-experts on a GPU without data-dependent shapes, so a CUDA graph can hold it.

- A step of few (token, expert) pairs (decodes): one program per pair and block of output
  columns multiplies the pair's row by its expert's weights (``pair_products``). Only the chosen
  experts are read, with nothing to sort; an expert two pairs chose is read twice.
- A step of many: the pairs are sorted by expert into blocks of rows (an expert's last block
  padded), and one grouped product runs every block against its expert's weights, reading each
  chosen expert's weights once per block of its pairs (``grouped``).

Checked against the per-expert loop of neuron/models/moe.py. The tiles: scripts/bench-kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import grid_sync, pdl_args


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


@triton.jit
def _grouped_kernel(X, W, Out, Pairs, BlockExpert, stride_x, stride_we, stride_wn, stride_o, N, K, P,
                    PER_ROW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    PDL: tl.constexpr):
    """Out[pair, n] = sum_k X[row, k] W[expert, n, k] for the rows of one block of pairs and one
    block of N; ``row`` is the pair's token (``PER_ROW`` pairs share a token) or the pair itself
    (PER_ROW 1)."""
    b = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    grid_sync(PDL)
    expert = tl.load(BlockExpert + b)
    if expert >= 0:
        pair = tl.load(Pairs + b * BM + tl.arange(0, BM))
        valid = pair < P
        row = pair // PER_ROW
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        w = W + expert * stride_we + n[None, :] * stride_wn
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            a = tl.load(X + row[:, None] * stride_x + k[None, :], mask=valid[:, None] & (k < K)[None, :], other=0.0)
            bt = tl.load(w + k[:, None], mask=(k < K)[:, None] & (n < N)[None, :], other=0.0)
            acc += tl.dot(a, bt)
        tl.store(Out + pair[:, None] * stride_o + n[None, :], acc.to(Out.dtype.element_ty),
                 mask=valid[:, None] & (n < N)[None, :])


def grouped(x: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor, P: int,
            per_row: int) -> torch.Tensor:
    """[P, N]: each pair's row of ``x`` (its token's: row ``pair // per_row``) times its expert's
    ``w`` [E, N, K]."""
    N, K = w.shape[1], w.shape[2]
    out = torch.empty(P, N, dtype=x.dtype, device=x.device)
    rows, BN, BK, warps, stages = tiles(P)
    _grouped_kernel[(block_expert.numel(), triton.cdiv(N, BN))](
        x, w, out, pairs, block_expert, x.stride(0), w.stride(0), w.stride(1), out.stride(0), N, K, P,
        PER_ROW=per_row, BM=rows, BN=BN, BK=BK, num_warps=warps, num_stages=stages, **pdl_args(x.device))
    return out


@triton.jit
def _pair_kernel(X, W, Out, Chosen, stride_x, stride_we, stride_wn, stride_o, N, K, first, E,
                 PER_ROW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """Out[pair, n] = sum_k X[row, k] W[expert - first, n, k] for one pair and block of N (nothing
    for a pair whose expert is not among the ``E`` held here); ``row`` as in ``_grouped_kernel``."""
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    grid_sync(PDL)
    e = tl.load(Chosen + p) - first
    if (e >= 0) & (e < E):
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        w = W + e * stride_we + n[:, None] * stride_wn
        x = X + (p // PER_ROW) * stride_x
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            km = k < K
            wt = tl.load(w + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += wt.to(tl.float32) * tl.load(x + k, mask=km, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + p * stride_o + n, tl.sum(acc, 1).to(Out.dtype.element_ty), mask=nm)


def pair_products(x: torch.Tensor, w: torch.Tensor, chosen: torch.Tensor, first: int, per_row: int) -> torch.Tensor:
    """[P, N] (P = chosen.numel()): each pair's row of ``x`` times its expert's ``w`` [E, N, K]
    (experts ``first ..``); rows of pairs routed elsewhere are left unwritten."""
    N, K = w.shape[1], w.shape[2]
    P = chosen.numel()
    out = torch.empty(P, N, dtype=x.dtype, device=x.device)
    BN, BK = (16, 256) if K >= 256 else (32, 128)
    _pair_kernel[(P, triton.cdiv(N, BN))](
        x, w, out, chosen, x.stride(0), w.stride(0), w.stride(1), out.stride(0), N, K, first, w.shape[0],
        PER_ROW=per_row, BN=BN, BK=BK, num_warps=4, num_stages=3, **pdl_args(x.device))
    return out


@triton.jit
def _weighted_down_kernel(H, W, Out, Chosen, Weights, stride_h, stride_we, stride_wn, stride_o, N, K, first, E,
                          TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """Out[t, n] = sum_j Weights[t, j] sum_k H[t * TOPK + j, k] W[Chosen[t, j] - first, n, k] over
    the token's choices whose expert is among the ``E`` held here (the others' rows of H are
    never read: their gate/up products were not written)."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    grid_sync(PDL)
    out = tl.zeros((BN,), dtype=tl.float32)
    for j in range(TOPK):
        e = tl.load(Chosen + t * TOPK + j) - first
        if (e >= 0) & (e < E):
            acc = tl.zeros((BN, BK), dtype=tl.float32)
            w = W + e * stride_we + n[:, None] * stride_wn
            h = H + (t * TOPK + j) * stride_h
            for k0 in range(0, K, BK):
                k = k0 + tl.arange(0, BK)
                km = k < K
                wt = tl.load(w + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
                acc += wt.to(tl.float32) * tl.load(h + k, mask=km, other=0.0).to(tl.float32)[None, :]
            out += tl.load(Weights + t * TOPK + j).to(tl.float32) * tl.sum(acc, 1)
    tl.store(Out + t * stride_o + n, out.to(Out.dtype.element_ty), mask=nm)


def weighted_down(h: torch.Tensor, down: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, first: int,
                  per_row: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, N]: each token's ``per_row`` rows of ``h`` (its choices' SiLU·mul, ``chosen`` their
    experts, flat) times their experts' ``down`` [E, N, K], weighted by ``weights`` and summed in
    float32 in one kernel (a decode step's last expert launch)."""
    N, K = down.shape[1], down.shape[2]
    T = chosen.numel() // per_row
    out = torch.empty(T, N, dtype=dtype, device=h.device)
    BN = 8 if T * N <= 4096 else 16  # enough programs to cover the GPU at one token
    _weighted_down_kernel[(T, triton.cdiv(N, BN))](
        h, down, out, chosen, weights.contiguous(), h.stride(0), down.stride(0), down.stride(1), out.stride(0), N, K,
        first, down.shape[0], TOPK=per_row, BN=BN, BK=256 if K >= 256 else 128, num_warps=4, num_stages=3,
        **pdl_args(h.device))
    return out


@triton.jit
def _route_kernel(Logits, Weights, Chosen, stride_l, E, TOPK: tl.constexpr, K_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """A token's router: the softmax of its logits in float32, its ``TOPK`` largest
    probabilities (largest first; of equals, the lowest expert), renormalised to sum to 1 when
    ``NORM``, written in ``Weights``' dtype with their experts."""
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
    tl.store(Weights + t * TOPK + slot, vals.to(Weights.dtype.element_ty), mask=slot < TOPK)
    tl.store(Chosen + t * TOPK + slot, idxs, mask=slot < TOPK)


def route(logits: torch.Tensor, k: int, norm: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``topk(softmax(logits, float32), k)`` (renormalised when ``norm``), the weights in
    ``dtype``: one launch in place of five."""
    T, E = logits.shape
    weights = torch.empty(T, k, dtype=dtype, device=logits.device)
    chosen = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    _route_kernel[(T,)](logits, weights, chosen, logits.stride(0), E, TOPK=k, K_PAD=triton.next_power_of_2(k),
                        E_PAD=triton.next_power_of_2(E), NORM=norm, num_warps=4 if E >= 512 else 1,
                        **pdl_args(logits.device))
    return weights, chosen


def sparse_moe(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, first: int, gate_up: torch.Tensor,
               down: torch.Tensor, silu_mul) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu_mul(gate_up_e(x_t))) over each token's chosen experts
    ``chosen`` [T, k] that this rank holds: ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] are
    experts ``first .. first + E`` (a pair routed elsewhere adds nothing here); ``silu_mul`` the
    step's fused SiLU·mul."""
    T, k = chosen.shape
    E = gate_up.shape[0]
    if T * k <= PAIRS_ALONE:
        flat = chosen.reshape(-1).contiguous()
        h = silu_mul(pair_products(x, gate_up, flat, first, k))
        return weighted_down(h, down, flat, weights, first, k, x.dtype)
    local = chosen - first
    here = (local >= 0) & (local < E)
    pairs, block_expert = sort_pairs(torch.where(here, local, E), E + 1, tiles(T * k)[0])  # E: elsewhere
    block_expert = torch.where(block_expert == E, -1, block_expert)
    h = silu_mul(grouped(x, gate_up, pairs, block_expert, T * k, k))
    y = grouped(h, down, pairs, block_expert, T * k, 1).view(T, k, -1)
    return (torch.where(here[..., None], y, 0) * weights[..., None].to(y.dtype)).sum(1)
