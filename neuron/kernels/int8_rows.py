"""Activation rows as int8 per group of 32 (``q = round(x / d)``, ``d = max|x| / 127``): the
operands of the packed decode product, made by ``quantize_rows`` or, fused, by the kernel that
writes the activations (``quantize_groups``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import grid_sync, pdl_args

QUANTIZE_ROWS_GROUPS = 8  # groups of 32 a program of _quantize_rows_kernel


@triton.jit
def quantize_groups(v, g, ok, q_ptr, d_ptr, t_ptr):
    """Store groups ``g`` [G] of one row (pointers at its start) from ``v``, their values [G, 2,
    16] in float32, where ``ok``: ``q = round(v / d)`` (int8), ``d = max|v| / 127`` (float32) and
    ``d * sum(q)`` of each half (float32). The decode kernel's operands; a kernel that writes the
    activations can call this on them too (``fused.py``: RMS norm, SiLU·mul)."""
    h = tl.arange(0, 2)
    j = tl.arange(0, 16)
    amax = tl.max(tl.max(tl.abs(v), axis=2), axis=1)
    d = amax / 127.0
    q = v * (127.0 / tl.where(amax > 0, amax, 1.0))[:, None, None]  # amax = 0: v = 0
    q = tl.where(q >= 0, tl.floor(q + 0.5), -tl.floor(0.5 - q))  # half away from zero
    at = g[:, None, None] * 32 + h[None, :, None] * 16 + j[None, None, :]
    tl.store(q_ptr + at, q.to(tl.int8), mask=ok[:, None, None])
    tl.store(d_ptr + g, d, mask=ok)
    tl.store(t_ptr + g[:, None] * 2 + h[None, :], tl.sum(q, axis=2) * d[:, None], mask=ok[:, None])


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, d_ptr, t_ptr, K, BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    """Row ``program_id(1)`` of ``x`` in groups of 32 (``quantize_groups``)."""
    grid_sync(PDL)
    r = tl.program_id(1)
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = g < K // 32
    at = g[:, None, None] * 32 + tl.arange(0, 2)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    x = tl.load(x_ptr + r * K + at, mask=ok[:, None, None], other=0.0).to(tl.float32)
    quantize_groups(x, g, ok, q_ptr + r * K, d_ptr + r * (K // 32), t_ptr + r * (K // 16))


def int8_rows_buffers(M: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``q`` int8 [M, K], ``d`` [M, K/32] and ``t`` [M, K/16] (float32)."""
    return (torch.empty((M, K), device=device, dtype=torch.int8),
            torch.empty((M, K // 32), device=device, dtype=torch.float32),
            torch.empty((M, K // 16), device=device, dtype=torch.float32))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as int8 per group of 32: ``q`` [M, K], ``d`` [M, K/32] and ``d * sum(q)``
    per 16 [M, K/16] (float32), the decode kernel's operands."""
    M, K = x.shape
    q, d, t = int8_rows_buffers(M, K, x.device)
    _quantize_rows_kernel[(triton.cdiv(K // 32, QUANTIZE_ROWS_GROUPS), M)](x, q, d, t, K,
                                                                          BLOCK_G=QUANTIZE_ROWS_GROUPS, num_warps=1,
                                                                          **pdl_args(x.device))
    return q, d, t
