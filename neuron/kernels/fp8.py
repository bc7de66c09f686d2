"""FP8 weights on the FP8 tensor cores (Hopper and Ada): ``y = x W^T`` where W is float8 e4m3
with a float32 scale per row and group of ``G`` columns (``models/fp8.Fp8Linear``: blocks of
128x128, rows, a tensor; 64 columns or more), and the rows of ``x`` are quantized to e4m3 on the fly
per group of ``BLOCK_K`` columns, ``d = max|x| / 448``: the dynamic activation scheme the FP8
checkpoints name, as transformers' and vLLM's FP8 linears run it. Each ``BLOCK_K`` step is one
FP8 product scaled by its row's ``d`` and its column's weight scale, accumulated in float32.

- Up to ``FUSED_ROWS`` rows (decode) one kernel quantizes each tile of ``x`` in registers (every
  program of a column tile does it again: ``x`` is small, and a second kernel would cost a launch
  and a round trip more per product) and splits K where a few rows over a narrow W make too few
  programs to keep the memory system busy (``packed.gemm_split``, ``packed.sum_parts``).
- More rows (prefill): ``quantize_rows_fp8`` writes ``x``'s e4m3 values and scales once, and
  cuBLAS's block-scaled product multiplies them (``scaled_mm_blocks``, weights in 128x128 blocks)
  or a Triton GEMM does, its tiles taken in groups of ``GROUP_M`` row tiles so that a column tile
  of W is read from L2 by the row tiles that need it.

Every path quantizes ``x`` the same way (the same groups, the same rounding); their sums differ
only in order and, on Hopper's warp-group MMA, in the bits it adds with. Only basic ``tl``
operations: the same source runs under ``TRITON_INTERPRET=1``, where the tests check it against
``reference_fp8_linear``.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import INTERPRETED, grid_sync, pdl_args
from .packed import gemm_split, sum_parts

log = logging.getLogger(__name__)

E4M3_MAX = 448.0
TINY = 1e-12  # the least max|x| a group is scaled by (a group of zeros stays zeros)
FUSED_ROWS = 16  # more rows than this: quantize x once, then multiply
# (BLOCK_M, BLOCK_N, num_warps, num_stages, programs a multiprocessor the split aims at) of the
# fused decode kernel, and for W of WIDE_N rows and more (scripts/bench-fp8 --sweep, H200,
# Qwen3-8B's o and gate/up at 1 row: 9.8 and 33.4 us against bfloat16's 12.4 and 49.7); a rank
# replaces them with what it measures at load (runner/linear.tune_fp8). BLOCK_K is the
# activation group (128 where the weight's groups allow it). GEMM_CONFIG: the prefill product's
# (BLOCK_M, BLOCK_N, num_warps, num_stages).
FUSED_CONFIG = (16, 64, 4, 3, 2)
WIDE_CONFIG = (16, 128, 4, 3, 2)
WIDE_N = 16384
# What a rank times at load for each FP8 weight shape, up to FUSED_ROWS rows (runner/linear.tune_fp8).
FUSED_CANDIDATES = ((16, 32, 4, 3, 4), (16, 64, 4, 3, 2), (16, 64, 4, 3, 4), (16, 64, 4, 4, 4), (16, 128, 4, 3, 2),
                    (16, 128, 4, 3, 4), (16, 128, 4, 3, 8))
GEMM_CONFIG = (128, 128, 8, 4)
GROUP_M = 8
CUBLAS = True  # blocks of 128x128: the prefill product by cuBLAS where torch offers it (blockwise_ok)


def activation_group(k: int, g: int) -> int:
    """The columns ``x`` is quantized by (``BLOCK_K``) for a weight of ``k`` columns in groups of
    ``g``: 128 or 64, dividing both; 0 where none does (the caller unpacks instead). Not 32: FP8
    products 32 deep came out up to 1% off on an H200 (Triton 3.6), exact in the interpreter."""
    return next((b for b in (128, 64) if k % b == 0 and (g >= k or g % b == 0)), 0)


@triton.jit
def _to_e4m3(v, EMU: tl.constexpr):
    """``v`` (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even. The
    interpreter's own conversion rounds some values across a power of two wrongly (124.3 to 64),
    so there (``EMU``) the value is first rounded in float32, which it then converts exactly."""
    if EMU:
        a = tl.abs(v)
        step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0) - 3.0)
        t = a / step
        f = tl.floor(t)
        up = (t - f > 0.5) | ((t - f == 0.5) & (f - 2.0 * tl.floor(f * 0.5) == 1.0))
        v = tl.where(v < 0, -1.0, 1.0) * (f + up.to(tl.float32)) * step
    return v.to(tl.float8e4nv)


@triton.jit
def _quantized_x(x_ptr, xs_ptr, rm, k0, M, K, KB, QUANT: tl.constexpr, BLOCK_K: tl.constexpr, EMU: tl.constexpr):
    """Rows ``rm`` of x at columns ``k0 .. k0 + BLOCK_K`` as e4m3 and their scales ``d``."""
    kk = k0 + tl.arange(0, BLOCK_K)
    at = rm[:, None] * K + kk[None, :]
    if QUANT:
        xv = tl.load(x_ptr + at, mask=rm[:, None] < M, other=0.0).to(tl.float32)
        d = tl.div_rn(tl.maximum(tl.max(tl.abs(xv), axis=1), 1e-12), 448.0)
        q = _to_e4m3(xv * tl.div_rn(1.0, d)[:, None], EMU)
    else:
        q = tl.load(x_ptr + at, mask=rm[:, None] < M, other=0.0).to(tl.float8e4nv)
        d = tl.load(xs_ptr + rm * KB + k0 // BLOCK_K, mask=rm < M, other=0.0).to(tl.float32)
    return q, d


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, M, N, K, K_SPLIT,
                     G: tl.constexpr, QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr, EMU: tl.constexpr,
                     PDL: tl.constexpr):
    """Tile (``pid_m``, ``pid_n``) of y over the K range of split part ``program_id(2)``.
    ``x``: [M, K] in a float dtype (``QUANT``) or e4m3 with ``xs`` [M, K / BLOCK_K];
    ``w``: e4m3 [N, K]; ``ws``: float32 [groups of G columns, N]. With ``SPLIT`` > 1 the
    float32 sums go to ``part`` [SPLIT, M, N]."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    rows_here = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    KB = K // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = tl.program_id(2) * K_SPLIT
    grid_sync(PDL)
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
        w = tl.load(w_ptr + n[:, None] * K + (k0 + kk)[None, :], mask=n[:, None] < N, other=0.0)
        ws = tl.load(ws_ptr + (k0 // G) * N + n, mask=n < N, other=0.0)
        xq, d = _quantized_x(x_ptr, xs_ptr, rm, k0, M, K, KB, QUANT, BLOCK_K, EMU)
        acc += tl.dot(xq, tl.trans(w)) * (d[:, None] * ws[None, :])
    out = (rm[:, None] < M) & (n[None, :] < N)
    if SPLIT == 1:
        tl.store(y_ptr + rm[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out)
    else:
        tl.store(part_ptr + (tl.program_id(2) * M + rm[:, None]) * N + n[None, :], acc, mask=out)


@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, S_ROW, S_COL, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                     EMU: tl.constexpr, PDL: tl.constexpr):
    """Row ``program_id(0)`` of x, ``GROUPS`` groups of ``BLOCK_K`` columns from group
    ``program_id(1) * GROUPS``: e4m3 values into ``q``, one float32 scale a group into ``s``."""
    grid_sync(PDL)
    row = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    KB = K // BLOCK_K
    at = row * K + g[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    ok = g[:, None] < KB
    xv = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
    d = tl.div_rn(tl.maximum(tl.max(tl.abs(xv), axis=1), 1e-12), 448.0)
    tl.store(q_ptr + at, _to_e4m3(xv * tl.div_rn(1.0, d)[:, None], EMU), mask=ok)
    tl.store(s_ptr + row * S_ROW + g * S_COL, d, mask=g < KB)


def quantize_rows_fp8(x: torch.Tensor, block_k: int, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as e4m3 values [M, K] and a float32 scale per row and ``block_k`` columns, [M,
    K / block_k]. With ``rows`` (at least M) both have that many rows, the scales stored by column
    (cuBLAS's layout), and rows past M hold whatever the memory held."""
    M, K = x.shape
    q = torch.empty((max(M, rows), K), device=x.device, dtype=torch.float8_e4m3fn)
    if rows:
        s = torch.empty((K // block_k, rows), device=x.device, dtype=torch.float32).t()
    else:
        s = torch.empty((M, K // block_k), device=x.device, dtype=torch.float32)
    groups = min(8, triton.next_power_of_2(K // block_k))
    _quantize_kernel[(M, triton.cdiv(K // block_k, groups))](x, q, s, M, K, s.stride(0), s.stride(1), BLOCK_K=block_k,
                                                             GROUPS=groups, EMU=INTERPRETED, num_warps=4,
                                                             **pdl_args(x.device))
    return q, s


@functools.cache
def blockwise_ok(device: torch.device) -> bool:
    """Whether torch multiplies FP8 with 1x128 and 128x128 block scales on ``device``
    (``torch.nn.functional.scaled_mm``, cuBLAS on Hopper) and gets ``reference_fp8_linear``'s
    values."""
    if device.type != "cuda" or not hasattr(F, "scaled_mm"):
        return False
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 512, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(256, 512, device=device, generator=g) * 50).to(torch.float8_e4m3fn)
    blocks = torch.rand(2, 4, device=device, generator=g) + 0.5
    ws = blocks.repeat_interleave(128, 0).t().contiguous()
    try:
        y = scaled_mm_blocks(x, w, blocks, torch.bfloat16).float()
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
        log.info("FP8 products of 128x128 blocks in Triton: torch's scaled_mm said %s", e)
        return False
    ref = reference_fp8_linear(x, w, ws, 128, 128)
    err = float((y - ref).abs().max() / ref.abs().max())
    if err > 1e-2:
        log.info("FP8 products of 128x128 blocks in Triton: torch's scaled_mm is off by %.2g", err)
    return err <= 1e-2


def scaled_mm_blocks(x: torch.Tensor, w: torch.Tensor, blocks: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's block-scaled product of ``x`` [M, K] and ``w`` with ``blocks`` [N / 128, K / 128];
    rows padded to a multiple of 16 (cuBLAS refused a 2,046-row prompt chunk:
    CUBLAS_STATUS_NOT_SUPPORTED)."""
    M = x.shape[0]
    q, s = quantize_rows_fp8(x, 128, rows=-(-M // 16) * 16)
    st = F.ScalingType
    return F.scaled_mm(q, w.t(), s, st.BlockWise1x128, blocks.t(), st.BlockWise128x128, output_dtype=out_dtype)[:M]


def fp8_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, g: int, block_k: int,
               out_dtype: torch.dtype | None = None, blocks: torch.Tensor | None = None,
               config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x`` [M, K] (a float dtype), ``w`` e4m3 [N, K], ``ws`` float32 [groups of ``g`` columns,
    N] (transposed: a step reads a row of it), ``block_k`` from ``activation_group`` -> ``y``
    [M, N] in ``out_dtype`` (default ``x``'s). ``blocks``: the same scales a 128x128 block,
    [N / 128, K / 128], where W has them: then cuBLAS multiplies more than ``FUSED_ROWS`` rows
    (where torch offers it, for K in whole 512s: it takes the blocks of K in fours). ``config``: the
    fused kernel's, up to ``FUSED_ROWS`` rows, where one was measured for this weight."""
    M, K = x.shape
    N = w.shape[0]
    assert w.dtype == torch.float8_e4m3fn and K % block_k == 0 and (g >= K or g % block_k == 0)
    x = x.contiguous()
    if M > FUSED_ROWS and CUBLAS and blocks is not None and K % 512 == 0 and blockwise_ok(x.device):
        return scaled_mm_blocks(x, w, blocks, torch.bfloat16).to(out_dtype or x.dtype)
    y = torch.empty((M, N), device=x.device, dtype=out_dtype or x.dtype)
    steps = K // block_k
    if M <= FUSED_ROWS:
        block_m, block_n, warps, stages, per_sm = config or (WIDE_CONFIG if N >= WIDE_N else FUSED_CONFIG)
        tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
        split = gemm_split(tiles, steps, per_sm, x.device)
        while steps % split:  # whole parts: each program's range ends inside K
            split //= 2
        k_split = steps // split * block_k
        part = torch.empty((split, M, N), device=x.device, dtype=torch.float32) if split > 1 else y
        _fp8_gemm_kernel[(tiles, 1, split)](x, x, w, ws, y, part, M, N, K, k_split, G=min(g, K), QUANT=True,
                                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=1, SPLIT=split,
                                         EMU=INTERPRETED, num_warps=warps, num_stages=stages,
                                         **pdl_args(x.device))
        if split > 1:
            sum_parts(part, y)
        return y
    q, s = quantize_rows_fp8(x, block_k)
    block_m, block_n, warps, stages = GEMM_CONFIG
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    _fp8_gemm_kernel[(tiles, 1, 1)](q, s, w, ws, y, y, M, N, K, K, G=min(g, K), QUANT=False, BLOCK_M=block_m,
                                 BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M, SPLIT=1, EMU=INTERPRETED,
                                 num_warps=warps, num_stages=stages, **pdl_args(x.device))
    return y


def reference_fp8_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, g: int, block_k: int) -> torch.Tensor:
    """``fp8_linear`` in torch, float32: the tests' definition of what the kernels compute."""
    M, K = x.shape
    xv = x.float().reshape(M, K // block_k, block_k)
    amax = xv.abs().amax(-1).clamp_min(TINY)
    d = amax / torch.full_like(amax, E4M3_MAX)  # on CUDA, ``/ E4M3_MAX`` multiplies by its reciprocal
    xq = (xv * (1.0 / d)[..., None]).to(torch.float8_e4m3fn).float().reshape(M, K)
    y = torch.zeros((M, w.shape[0]), dtype=torch.float32, device=x.device)
    for b in range(K // block_k):
        cols = slice(b * block_k, (b + 1) * block_k)
        y += (xq[:, cols] @ w[:, cols].float().t()) * d[:, b, None] * ws[min(b * block_k, K - 1) // g][None, :]
    return y
