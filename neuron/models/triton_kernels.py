"""GPU kernels for packed weights (Triton): ``y = x W^T`` with ``W`` in the CPU kernel's layout
(``quant.PackedLinear``: 4-bit or 8-bit integers in groups of 32 along the input dimension,
``w = s * u + m`` per group, or per 16 for the K-quants), bfloat16 or float16 activations,
float32 accumulation. One program computes a BLOCK_M x BLOCK_N tile of ``y``; each K step
unpacks a BLOCK_N x BLOCK_K tile of ``W`` in registers and feeds ``tl.dot``.

Only basic ``tl`` operations (loads with computed offsets, shifts, masks, ``tl.dot``), so the
same source runs on Triton 3.6 on the GPU hosts and under ``TRITON_INTERPRET=1`` on a CPU, where
the tests check it against the torch reference ``reference_qlinear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qlinear_kernel(x_ptr, u_ptr, s_ptr, m_ptr, y_ptr, M, N, K, NS,
                    BITS: tl.constexpr, GS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_bytes = K * BITS // 8
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        if BITS == 4:  # byte j of a group of 32 holds u[j] (low nibble) and u[j + 16] (high nibble)
            byte = (k // 32) * 16 + (k % 16)
            shift = ((k % 32) // 16) * 4
        else:
            byte = k
            shift = k * 0
        mask_w = (rn[:, None] < N) & (k[None, :] < K)
        raw = tl.load(u_ptr + rn[:, None] * row_bytes + byte[None, :], mask=mask_w, other=0).to(tl.int32)
        q = (raw >> shift[None, :]) & ((1 << BITS) - 1)
        g = k // GS
        s = tl.load(s_ptr + rn[:, None] * NS + g[None, :], mask=mask_w, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + rn[:, None] * NS + g[None, :], mask=mask_w, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) * s + m).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def qlinear(x: torch.Tensor, u: torch.Tensor, s: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` [M, K] (bf16/fp16); ``u`` uint8 [N, K*bits/8]; ``s``, ``m`` [N, K/32] or [N, K/16]
    (any float dtype, float32 keeps K-quant scales exact) -> ``y`` [M, N] in ``x``'s dtype."""
    M, K = x.shape
    N = u.shape[0]
    NS = s.shape[1]
    gs = K // NS
    assert bits in (4, 8) and K % 32 == 0 and gs in (16, 32) and u.shape[1] * 8 == K * bits
    x = x.contiguous()
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _qlinear_kernel[grid](x, u, s, m, y, M, N, K, NS, BITS=bits, GS=gs, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_K=block_k)
    return y


def reference_qlinear(x: torch.Tensor, u: torch.Tensor, s: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """The same product in float32 torch ops (the weight dequantized whole)."""
    N = u.shape[0]
    K = x.shape[1]
    if bits == 4:
        g = u.view(N, K // 32, 16)
        q = torch.cat([g & 15, g >> 4], dim=-1).reshape(N, K)
    else:
        q = u
    gs = K // s.shape[1]
    w = q.view(N, -1, gs).float() * s.float()[..., None] + m.float()[..., None]
    return x.float() @ w.view(N, K).t()
