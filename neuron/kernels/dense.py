"""The dense skinny product of a decode step (Triton): a few rows times a weight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import grid_sync, pdl_args


# ---------------------------------------------------------------------------------------------
# Skinny GEMM (a decode step's few rows times a weight): y[M, N] = x[M, K] W[N, K]^T, M <= 16.
# Each program reads BLOCK_N rows of W once; the rows of x are padded to 16 for the MMA.

GEMV_CONFIGS: tuple[tuple[int, int, int], ...] = ((16, 256, 4), (32, 256, 4), (32, 512, 3), (64, 128, 4))


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(X, W, Out, M, N, K, stride_xm, stride_wn, stride_om, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    grid_sync(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, 16)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(Out + m[:, None] * stride_om + n[None, :], acc.to(Out.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def gemv(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int] = GEMV_CONFIGS[0]) -> torch.Tensor:
    M, K = x.shape
    N = weight.shape[0]
    assert M <= 16 and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    block_n, block_k, stages = config
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
                                              BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=stages,
                                              **pdl_args(x.device))
    return out


