"""Sparse experts of packed weights (``PackedLinear``'s groups of 4- or 8-bit integers, every
expert's stacked) on a GPU, in the two shapes of work of ``moe``'s dense kernels and with no
data-dependent shape either, so a CUDA graph holds them:

- few (token, expert) pairs (decodes): a program per pair and block of an expert's gate/up rows
  writes their SiLU product, then a program per token and block of output columns sums its
  pairs' down products, weighted (``decode_experts``); only the chosen experts' bytes are read.
- many (prompts): ``moe.grouped``'s product of blocks of pairs sorted by expert, its W tiles
  unpacked to the activations' dtype here (``expert_rows``).

W is unpacked with float operations (``packed_gemm.weight_tile``), as the interpreter also runs
it. A shared expert is not carried along (it is its own ``PackedLinear``s or dense matrices)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import grid_sync, pdl_args
from .packed_gemm import weight_tile
from .packed_scales import scale_words


class PackedExperts(NamedTuple):
    """Experts' matrices W [E, N, K] packed: ``u`` uint8 [E, N, K * bits / 8] and ``sm`` each
    group's scale and offset, [E, N, K / group, 2] (``pair_scales``, float16 or float32)."""

    u: torch.Tensor
    sm: torch.Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, int, int]:
        E, N, NS = self.sm.shape[:3]
        return E, N, self.u.shape[2] * 8 // self.bits

    def words(self) -> torch.Tensor:
        """The scale pairs as one word each, [E, N, NS]."""
        E, N, NS = self.sm.shape[:3]
        return scale_words(self.sm.view(E * N, NS, 2)).view(E, N, NS)


@triton.jit
def expert_rows(U, S, e, n, k0, N, K, NS, stride_ue, stride_un, stride_se, BITS: tl.constexpr,
                GS: tl.constexpr, BK: tl.constexpr):
    """Expert ``e``'s rows ``n`` at columns ``k0 .. k0 + BK`` in float32 (0 past N and K)."""
    g = k0 // 32 + tl.arange(0, BK // 32)
    return weight_tile(U + e * stride_ue, S + e * stride_se, n, g, N, K, NS, stride_un, tl.float32, BITS, GS,
                       False, False, False)


@triton.jit
def _gate_up_kernel(X, U, S, H, Chosen, stride_x, stride_ue, stride_un, stride_se, stride_h, I, K, NS, first, E,
                    PER_ROW: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, PDL: tl.constexpr):
    """H[p, n] = silu(g) * u of pair ``p``'s row of X (its token's, ``p // PER_ROW``) and its
    expert's gate rows ``n`` and up rows ``I + n`` of W [E, 2I, K]; nothing for a pair whose
    expert is not among the ``E`` held here."""
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    grid_sync(PDL)
    e = tl.load(Chosen + p) - first
    if (e >= 0) & (e < E):
        x = X + (p // PER_ROW) * stride_x
        g = tl.zeros((BN, BK), dtype=tl.float32)
        u = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            xk = tl.load(x + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
            g += expert_rows(U, S, e, n, k0, I, K, NS, stride_ue, stride_un, stride_se, BITS, GS, BK) * xk
            u += expert_rows(U, S, e, I + n, k0, 2 * I, K, NS, stride_ue, stride_un, stride_se, BITS, GS, BK) * xk
        gs, us = tl.sum(g, 1), tl.sum(u, 1)
        tl.store(H + p * stride_h + n, (gs * tl.sigmoid(gs) * us).to(H.dtype.element_ty), mask=n < I)


@triton.jit
def _weighted_down_kernel(H, U, S, Out, Chosen, Weights, stride_h, stride_ue, stride_un, stride_se, stride_o,
                          stride_w, N, K, NS, first, E, TOPK: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """Out[t, n] = sum_j Weights[t, j] (W[Chosen[t, j] - first, n] . H[t TOPK + j]) over the
    token's choices held here (a choice held elsewhere reads nothing: its K is taken as 0)."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    grid_sync(PDL)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    blocks = tl.cdiv(K, BK)
    for i in range(0, TOPK * blocks):
        j = i // blocks
        e = tl.load(Chosen + t * TOPK + j) - first
        held = (e >= 0) & (e < E)
        kh = tl.where(held, K, 0)
        e = tl.where(held, e, 0)
        k0 = (i % blocks) * BK
        k = k0 + tl.arange(0, BK)
        h = tl.load(H + (t * TOPK + j) * stride_h + k, mask=k < kh, other=0.0).to(tl.float32)
        h = h * tl.load(Weights + t * stride_w + j).to(tl.float32)
        acc += expert_rows(U, S, e, n, k0, N, kh, NS, stride_ue, stride_un, stride_se, BITS, GS, BK) * h[None, :]
    tl.store(Out + t * stride_o + n, tl.sum(acc, 1).to(Out.dtype.element_ty), mask=n < N)


# the decode kernels' (block of rows, block of K, warps, stages), as moe.DECODE's
DECODE = {"gate_up": (16, 128, 4, 3), "down": (16, 128, 4, 3)}


def decode_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, first: int, gate_up: PackedExperts,
                   down: PackedExperts) -> torch.Tensor:
    """[T, H]: each token's chosen experts' SiLU MLPs (``chosen`` [T, k]; those among the ``E``
    of ``gate_up`` [E, 2I, H] and ``down`` [E, H, I], experts ``first ..``) of its row of ``x``,
    weighted by ``weights`` [T, >= k] and summed in float32: two launches."""
    T, k = chosen.shape
    E, I2, K = gate_up.shape
    flat = chosen.reshape(-1).contiguous()
    h = torch.empty(T * k, I2 // 2, dtype=x.dtype, device=x.device)
    words = gate_up.words()
    BN, BK, warps, stages = DECODE["gate_up"]
    _gate_up_kernel[(T * k, triton.cdiv(I2 // 2, BN))](
        x, gate_up.u, words, h, flat, x.stride(0), gate_up.u.stride(0), gate_up.u.stride(1), words.stride(0),
        h.stride(0), I2 // 2, K, words.shape[2], first, E, PER_ROW=k, BITS=gate_up.bits, GS=K // words.shape[2],
        BN=BN, BK=BK, num_warps=warps, num_stages=stages, **pdl_args(x.device))
    N = down.shape[1]
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    words = down.words()
    BN, BK, warps, stages = DECODE["down"]
    _weighted_down_kernel[(T, triton.cdiv(N, BN))](
        h, down.u, words, out, flat, weights, h.stride(0), down.u.stride(0), down.u.stride(1), words.stride(0),
        out.stride(0), weights.stride(0), N, I2 // 2, words.shape[2], first, E, TOPK=k, BITS=down.bits,
        GS=(I2 // 2) // words.shape[2], BN=BN, BK=min(BK, triton.next_power_of_2(I2 // 2)), num_warps=warps,
        num_stages=stages, **pdl_args(x.device))
    return out
