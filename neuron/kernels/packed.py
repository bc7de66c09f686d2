"""GPU kernels for packed weights (Triton): ``y = x W^T`` with ``W`` in the CPU kernel's layout
(``packed_linear.PackedLinear``: 4-bit or 8-bit integers in groups of 32 along the input dimension,
``w = s * u + m`` per group, or per 16 for the K-quants), bfloat16 or float16 activations,
float32 accumulation.

- Up to ``GEMV_ROWS`` rows of ``x`` (decode) the product is memory-bound, and a kernel that
  converts every weight to a float spends more instructions than the memory allows (an H200
  streams ~2 weights a cycle per scheduler). So, as llama.cpp's CUDA kernels do, the rows of
  ``x`` are first quantized to int8 per group of 32 (``int8_rows.quantize_rows``: ``q = round(x /
  d)``, ``d = max|x| / 127``) and ``_qgemv_kernel`` multiplies W's bytes as they are, four
  products an instruction (``dp4a``): ``y = sum_g s d (u . q) + m d sum(q)``. With int8
  activations the largest error of an output is 0.4-0.7% of the largest output on random data
  (tests/test_quant_triton.py), about what rounding the activations to bfloat16 costs.
- Up to ``GEMM_ROWS`` rows (a batch of decodes, a short prompt): ``packed_gemm.qgemm`` unpacks
  each tile of W in registers and multiplies it on the tensor cores (past 64 rows, once for each
  tile of 64 rows of x).
- Otherwise (prefill): ``_dequant_kernel`` writes the weight to ``x``'s dtype (whole, or in
  slices of rows where it is larger than ``DEQUANT_BYTES``) and cuBLAS multiplies: the product
  is compute-bound there, and writing the weight once costs less than unpacking it in every
  tile of a GEMM.

Only basic ``tl`` operations and one instruction of inline PTX (``dp4a``, which
``TRITON_INTERPRET=1`` cannot run: there ``_dp4a`` computes the same sum from shifted bytes), so
the same source runs on Triton 3.6 on the GPU hosts and under the interpreter on a CPU, where
the tests check it against the torch references ``reference_qlinear`` and
``reference_quantized_rows``.
"""


from __future__ import annotations

import torch
import triton
import triton.language as tl

from .int8_rows import quantize_rows
from .launch import INTERPRETED, TL_DTYPES, grid_sync, multiprocessors, pdl_args
from .packed_gemm import GEMM_ROWS, qgemm, unpair
from .packed_mma import MMA_DEFAULT_ROWS, qmma
from .packed_mma import supported as mma_supported
from .packed_scales import scale_words

@triton.jit
def _load(at, ok, EVEN: tl.constexpr, POLICY: tl.constexpr):
    """``at`` where ``ok``, else 0; unmasked when the tiles divide the matrix (``EVEN``): a
    masked load zeroes its registers first, an instruction per element."""
    if EVEN:
        return tl.load(at, eviction_policy=POLICY)
    else:
        return tl.load(at, mask=ok, other=0, eviction_policy=POLICY)


@triton.jit
def _weight_tiles(u_ptr, sm_ptr, n, g, in_k, ok, N, NS, stride_u, BITS: tl.constexpr, GS: tl.constexpr,
                  EVEN: tl.constexpr, POLICY: tl.constexpr):
    """Rows ``n`` of W at groups ``g`` as float32 tiles [rows, groups, 16]: the first and the
    second half of each group of 32. A 4-bit byte holds element j of a group in its low nibble
    and j + 16 in its high one, so an 8-bit group is read as two such tiles."""
    j = tl.arange(0, 16)
    at_u = u_ptr + n[:, None, None] * stride_u + (g[:, None] * (4 * BITS) + j[None, :])[None, :, :]
    raw = _load(at_u, ok, EVEN, POLICY)
    if BITS == 8:
        q_lo = raw.to(tl.float32)
        q_hi = _load(at_u + 16, ok, EVEN, POLICY).to(tl.float32)
    else:
        q_lo = (raw & 15).to(tl.float32)
        q_hi = (raw >> 4).to(tl.float32)
    s_lo, m_lo, s_hi, m_hi = _group_scales(sm_ptr, n, g, (n[:, None] < N) & in_k[None, :], NS, GS, EVEN, "")
    return q_lo * s_lo[:, :, None] + m_lo[:, :, None], q_hi * s_hi[:, :, None] + m_hi[:, :, None]


@triton.jit
def _group_scales(sm_ptr, n, g, ok, NS, GS: tl.constexpr, EVEN: tl.constexpr, POLICY: tl.constexpr):
    """The scales and mins [rows, groups] (float32) of the first and the second half of groups
    ``g`` of rows ``n``: one pair per group of 32, or per 16 for the K-quants, or per 64 or 128
    (``coarsen_scales``), each pair one word of ``sm_ptr``."""
    if GS <= 32:
        at = sm_ptr + n[:, None] * NS + g[None, :] * (32 // GS)
    else:
        at = sm_ptr + n[:, None] * NS + g[None, :] // (GS // 32)
    s_lo, m_lo = unpair(_load(at, ok, EVEN, POLICY))
    if GS == 16:
        s_hi, m_hi = unpair(_load(at + 1, ok, EVEN, POLICY))
    else:
        s_hi = s_lo
        m_hi = m_lo
    return s_lo, m_lo, s_hi, m_hi


@triton.jit
def _dp4a(a, b, c, EMU: tl.constexpr):
    """``c`` plus the products of ``a``'s 4 unsigned bytes with ``b``'s 4 signed bytes (int32
    words): one ``dp4a`` on the GPU; shifted bytes under the interpreter (``EMU``)."""
    if EMU:
        for sh in tl.static_range(0, 32, 8):
            c += ((a >> sh) & 255) * ((b << (24 - sh)) >> 24)
        return c
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _packed_groups(w_ptr, sm_ptr, n, g, N, K, NS, stride_w, BITS: tl.constexpr, GS: tl.constexpr,
                   EVEN: tl.constexpr):
    """Rows ``n`` of W at groups ``g`` for the decode kernel: the bytes of each group's halves as
    int32 words [rows, groups, 4] (elements 0..15 and 16..31), and the halves' scales and mins
    [rows, groups] in float32."""
    i4 = tl.arange(0, 4)
    okg = g < K // 32
    at = w_ptr + n[:, None, None] * stride_w + (g[:, None] * BITS + i4[None, :])[None]
    ok = (n[:, None, None] < N) & okg[None, :, None]
    w_lo = _load(at, ok, EVEN, "evict_first")
    if BITS == 8:
        w_hi = _load(at + 4, ok, EVEN, "evict_first")
    else:
        w_hi = (w_lo >> 4) & 0x0F0F0F0F
        w_lo = w_lo & 0x0F0F0F0F
    s_lo, m_lo, s_hi, m_hi = _group_scales(sm_ptr, n, g, (n[:, None] < N) & okg[None, :], NS, GS, EVEN,
                                           "evict_first")
    return w_lo, w_hi, s_lo, m_lo, s_hi, m_hi


@triton.jit
def _row(w_lo, w_hi, s_lo, m_lo, s_hi, m_hi, g, q_ptr, d_ptr, t_ptr, r: tl.constexpr, M, K, GS: tl.constexpr,
         BLOCK_M: tl.constexpr, EVEN: tl.constexpr, EMU: tl.constexpr):
    """Groups ``g`` of W (as ``_packed_groups`` gives them) times row ``r`` of the quantized
    ``x``: [rows of W, groups] (zero past row ``M``; ``EVEN``: ``M == BLOCK_M``, no masks).

    x's words and scales are loaded as [1, groups, ...] tiles, whose layout is W's tile's, or for
    one row of x as [groups, ...] and then expanded: whichever compiles shorter. In the sm_90 code
    of Triton 3.6 (the GPU image's), at 8 rows of x over 2 rows of W and 32 groups, expanding
    after the load costs shuffles for every row of x (47 instructions a product of a row of x, a
    row of W and a group, against 29); at one row it is the other way (143 instructions a step
    against 153; 67 against 119 for 4 rows of W on 4 warps)."""
    i4 = tl.arange(0, 4)
    okr = (g < K // 32) & (tl.full(g.shape, r, tl.int32) < M)
    at_q = q_ptr + r * (K // 4) + g[:, None] * 8 + i4[None, :]
    okq = okr[:, None] & (i4[None, :] < 4)
    at_d = d_ptr + r * (K // 32) + g
    at_t = t_ptr + r * (K // 16) + g * 2
    if BLOCK_M == 1:
        q_lo = _load(at_q, okq, EVEN, "evict_last")[None]
        q_hi = _load(at_q + 4, okq, EVEN, "evict_last")[None]
        d = _load(at_d, okr, EVEN, "evict_last")[None, :]
        t_lo = _load(at_t, okr, EVEN, "evict_last")[None, :]
        t_hi = _load(at_t + 1, okr, EVEN, "evict_last")[None, :]
    else:
        q_lo = _load(at_q[None], okq[None], EVEN, "evict_last")
        q_hi = _load(at_q[None] + 4, okq[None], EVEN, "evict_last")
        d = _load(at_d[None, :], okr[None, :], EVEN, "evict_last")
        t_lo = _load(at_t[None, :], okr[None, :], EVEN, "evict_last")
        t_hi = _load(at_t[None, :] + 1, okr[None, :], EVEN, "evict_last")
    if GS == 16:
        p_lo = tl.sum(_dp4a(w_lo, q_lo, tl.zeros_like(w_lo), EMU), axis=2).to(tl.float32)
        p_hi = tl.sum(_dp4a(w_hi, q_hi, tl.zeros_like(w_hi), EMU), axis=2).to(tl.float32)
        return p_lo * (s_lo * d) + p_hi * (s_hi * d) + m_lo * t_lo + m_hi * t_hi
    else:  # one scale for both halves: one sum
        p = tl.sum(_dp4a(w_hi, q_hi, _dp4a(w_lo, q_lo, tl.zeros_like(w_lo), EMU), EMU), axis=2).to(tl.float32)
        return p * (s_lo * d) + m_lo * (t_lo + t_hi)


@triton.jit
def _qgemv_groups(a0, a1, a2, a3, a4, a5, a6, a7, w_lo, w_hi, s_lo, m_lo, s_hi, m_hi, g, q_ptr, d_ptr, t_ptr, M,
                  K, GS: tl.constexpr, BLOCK_M: tl.constexpr, EVEN: tl.constexpr, EMU: tl.constexpr):
    """The accumulators of rows 0..BLOCK_M-1 of x ([rows of W, groups] each) plus their products
    with groups ``g`` of W. One accumulator a row, not one tensor [rows of x, ...]: adding a row's
    part into a slice of such a tensor costs a select over all of it, or shuffles."""
    a0 += _row(w_lo, w_hi, s_lo, m_lo, s_hi, m_hi, g, q_ptr, d_ptr, t_ptr, 0, M, K, GS, BLOCK_M, EVEN, EMU)
    if BLOCK_M > 1:
        a1 += _row(w_lo, w_hi, s_lo, m_lo, s_hi, m_hi, g, q_ptr, d_ptr, t_ptr, 1, M, K, GS, BLOCK_M, EVEN, EMU)
    if BLOCK_M > 2:
        a2 += _row(w_lo, w_hi, s_lo, m_lo, s_hi, m_hi, g, q_ptr, d_ptr, t_ptr, 2, M, K, GS, BLOCK_M, EVEN, EMU)
        a3 += _row(w_lo, w_hi, s_lo, m_lo, s_hi, m_hi, g, q_ptr, d_ptr, t_ptr, 3, M, K, GS, BLOCK_M, EVEN, EMU)
    if BLOCK_M > 4:
        a4 += _row(w_lo, w_hi, s_lo, m_lo, s_hi, m_hi, g, q_ptr, d_ptr, t_ptr, 4, M, K, GS, BLOCK_M, EVEN, EMU)
        a5 += _row(w_lo, w_hi, s_lo, m_lo, s_hi, m_hi, g, q_ptr, d_ptr, t_ptr, 5, M, K, GS, BLOCK_M, EVEN, EMU)
        a6 += _row(w_lo, w_hi, s_lo, m_lo, s_hi, m_hi, g, q_ptr, d_ptr, t_ptr, 6, M, K, GS, BLOCK_M, EVEN, EMU)
        a7 += _row(w_lo, w_hi, s_lo, m_lo, s_hi, m_hi, g, q_ptr, d_ptr, t_ptr, 7, M, K, GS, BLOCK_M, EVEN, EMU)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _store_row(y_ptr, acc, r: tl.constexpr, n, M, N, ROUND: tl.constexpr):
    """Row ``r`` of y: the sums rounded to ``ROUND`` (x's dtype), stored as ``y``'s dtype."""
    tl.store(y_ptr + r * N + n, tl.sum(acc, axis=1).to(ROUND).to(y_ptr.dtype.element_ty),
             mask=(n < N) & (tl.full(n.shape, r, tl.int32) < M))


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for 2..8 rows
def _qgemv_kernel(q_ptr, d_ptr, t_ptr, w_ptr, sm_ptr, y_ptr, M, N, K, NS, stride_w,
                  BITS: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_G: tl.constexpr, EVEN: tl.constexpr, EMU: tl.constexpr, ROUND: tl.constexpr,
                  PDL: tl.constexpr):
    """Rows ``0..M-1`` (``M <= BLOCK_M <= 8``) of the quantized ``x`` (``q`` as int32 words,
    ``d``, ``t``: see ``_quantize_rows_kernel``) times ``BLOCK_N`` packed rows of W (int32
    words), ``BLOCK_G`` groups of 32 a step.

    A thread holds 16 bytes of a row of W at a time (tiles [rows of W, groups, 4 words]), so the
    sums over a group stay in its registers: an 8-bit group is two such tiles (elements 0..15 and
    16..31); a 4-bit group is one, whose low nibbles are elements 0..15 (byte j: element j) and
    high nibbles 16..31. ``x``'s words are loaded in the same shape, with no row dimension, so
    every row of W in a thread shares them; each row of x has an accumulator of its own
    (``_qgemv_groups``).

    The first step's groups of W are loaded before ``grid_sync``: no kernel writes W, so under
    programmatic dependent launch (``pdl``) the kernel fetches them while the one that writes
    ``x`` still runs. (Loading every next step ahead as well, two steps in flight, made a q8_0
    decode step 14% slower on an H200.)"""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    gi = tl.arange(0, BLOCK_G)
    a0 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    w_lo, w_hi, s_lo, m_lo, s_hi, m_hi = _packed_groups(w_ptr, sm_ptr, n, gi, N, K, NS, stride_w, BITS, GS, EVEN)
    grid_sync(PDL)
    a0, a1, a2, a3, a4, a5, a6, a7 = _qgemv_groups(a0, a1, a2, a3, a4, a5, a6, a7, w_lo, w_hi, s_lo, m_lo, s_hi,
                                                   m_hi, gi, q_ptr, d_ptr, t_ptr, M, K, GS, BLOCK_M, EVEN, EMU)
    for g0 in range(BLOCK_G, K // 32, BLOCK_G):
        w_lo, w_hi, s_lo, m_lo, s_hi, m_hi = _packed_groups(w_ptr, sm_ptr, n, g0 + gi, N, K, NS, stride_w, BITS,
                                                            GS, EVEN)
        a0, a1, a2, a3, a4, a5, a6, a7 = _qgemv_groups(a0, a1, a2, a3, a4, a5, a6, a7, w_lo, w_hi, s_lo, m_lo, s_hi,
                                                       m_hi, g0 + gi, q_ptr, d_ptr, t_ptr, M, K, GS, BLOCK_M, EVEN,
                                                       EMU)
    _store_row(y_ptr, a0, 0, n, M, N, ROUND)
    if BLOCK_M > 1:
        _store_row(y_ptr, a1, 1, n, M, N, ROUND)
    if BLOCK_M > 2:
        _store_row(y_ptr, a2, 2, n, M, N, ROUND)
        _store_row(y_ptr, a3, 3, n, M, N, ROUND)
    if BLOCK_M > 4:
        _store_row(y_ptr, a4, 4, n, M, N, ROUND)
        _store_row(y_ptr, a5, 5, n, M, N, ROUND)
        _store_row(y_ptr, a6, 6, n, M, N, ROUND)
        _store_row(y_ptr, a7, 7, n, M, N, ROUND)


@triton.jit
def _split_sum_kernel(part_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``y`` = the sum of the ``SPLIT`` float32 parts [SPLIT, MN] a split-K product left, in
    ``y``'s dtype."""
    grid_sync(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["ROWS"])  # an embedding lookup's rows are the step's tokens
def _dequant_kernel(u_ptr, sm_ptr, ids_ptr, w_ptr, ROWS, N, K, NS, stride_u, BITS: tl.constexpr, GS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr):
    """``ROWS`` rows of W (N rows) as ``w_ptr``'s dtype, [ROWS, K] row-major: rows 0..N-1, or
    with ``GATHER`` row ``ids[i]`` as row i (an embedding lookup)."""
    grid_sync(PDL)
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = tl.load(ids_ptr + i, mask=i < ROWS, other=0) if GATHER else i
    g = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    in_k = g < K // 32
    ok = (i[:, None, None] < ROWS) & in_k[None, :, None]
    w_lo, w_hi = _weight_tiles(u_ptr, sm_ptr, n, g, in_k, ok, N, NS, stride_u, BITS, GS, False, "")
    at = w_ptr + i[:, None, None] * K + (g[:, None] * 32 + tl.arange(0, 16)[None, :])[None, :, :]
    tl.store(at, w_lo.to(w_ptr.dtype.element_ty), mask=ok)
    tl.store(at + 16, w_hi.to(w_ptr.dtype.element_ty), mask=ok)


# (BLOCK_N, BLOCK_G, num_warps) of the decode kernel by rows of x rounded up to a power of two, for
# K < LONG_K and for K >= LONG_K (the MLP's down projection); overridable for tuning (measured on
# an H200 with scripts/bench-qlinear --sweep; 2-8 rows with the kernel's accumulators by row, on
# Qwen3-8B's four shapes at 4 and 8 bits: a config near the fastest of each, the tuner picks per shape).
GEMV_CONFIG = {1: (2, 32, 1), 2: (2, 32, 1), 4: (2, 32, 1), 8: (4, 32, 1)}
GEMV_LONG_K_CONFIG = {1: (1, 64, 1), 2: (1, 32, 1), 4: (2, 32, 1), 8: (4, 32, 1)}
LONG_K = 8192
GEMV_ROWS = 8  # more rows than this: the tensor-core kernel
# BLOCK_N, BLOCK_K, num_warps (H200, Qwen3-8B's four q4 shapes, .gpu/dq.py: 133.3 us a layer against
# 137.7 for (8, 512, 4); other conversions and one contiguous store per group were no faster)
DEQUANT_CONFIG = (2, 2048, 8)
GATHER_CONFIG = (1, 512, 4)  # the same for a few rows by id (dequantize(ids=...): the embedding)
# The most of W unpacked at a time, in bytes: all of an 8B model's gate/up (201 MB) in one product.
# Its slices of 8192 rows took cuBLAS 0.34 ms more a 95-token prompt, and their copies into y 0.38;
# with this and the config above a q4 Qwen3-8B prompt of 95 tokens took 12.23 ms, not 13.60 (H200,
# in-process prefill graph, .gpu/pt.py). Unpacking the next matrix on a second stream while this
# one is multiplied gained nothing (11.8-12.0 ms either way): cuBLAS's kernels fill every SM.
DEQUANT_BYTES = 256 << 20


def qlinear(x: torch.Tensor, u: torch.Tensor, sm: torch.Tensor, bits: int,
            int8_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            configs: dict[int, tuple[int, ...]] | None = None,
            out_dtype: torch.dtype | None = None, unpack: str = "split") -> torch.Tensor:
    """``x`` [M, K] (bf16/fp16); ``u`` uint8 [N, K*bits/8]; ``sm`` the scale and offset of each
    group of 32 or 16, [N, K/32 or K/16, 2] (``pair_scales``) -> ``y`` [M, N] in ``x``'s dtype,
    or in ``out_dtype`` holding the same values (the LM head's float32 logits: up to
    ``GEMV_ROWS`` rows the decode kernel stores them in one launch where a conversion took another;
    rounded to ``x``'s dtype first, so that they tie where the dense model's logits tie).
    ``int8_rows``: ``quantize_rows(x)`` if the kernel that wrote ``x`` made it too.
    ``configs``: by rows of x (a power of two, at least 16 past ``GEMV_ROWS``), the config
    measured fastest for this weight (``runner/linear.tune_packed``): the decode kernel's
    (BLOCK_N, BLOCK_G, num_warps), or the tensor-core kernel's (BLOCK_N, BLOCK_K, num_warps,
    num_stages), which may be the faster from 4 rows up, or ``("mma", ...)``: the CUDA C++ product's
    (``packed_mma.qmma``); else the CUDA C++ product for ``MMA_DEFAULT_ROWS`` rows where it takes W
    and x, ``GEMV_CONFIG``'s or ``GEMM_CONFIG``'s.
    ``unpack``: how the tensor-core kernel unpacks W (``packed_scales.unpack_modes``)."""
    M, K = x.shape
    N = u.shape[0]
    words = scale_words(sm)
    NS = words.shape[1]
    gs = K // NS
    assert bits in (4, 8) and K % 32 == 0 and gs in (16, 32, 64, 128) and K % gs == 0 and u.shape[1] * 8 == K * bits
    x = x.contiguous()
    if M > GEMV_ROWS and out_dtype not in (None, x.dtype):
        return qlinear(x, u, sm, bits, int8_rows, configs, unpack=unpack).to(out_dtype)
    y = torch.empty((M, N), device=x.device, dtype=out_dtype or x.dtype)
    config = (configs or {}).get(triton.next_power_of_2(M) if M <= GEMV_ROWS else max(16, triton.next_power_of_2(M)))
    mma = config is not None and config[0] == "mma"
    if (mma or config is None and M in MMA_DEFAULT_ROWS) and M <= GEMM_ROWS and out_dtype in (None, x.dtype) \
            and mma_supported(x, bits, K, NS, unpack):
        return qmma(x, u, words, y, unpack, config[1:] if mma else None)
    tensor_cores = config is not None and len(config) >= 4 and not mma and out_dtype in (None, x.dtype)
    if M <= GEMV_ROWS and not tensor_cores:
        fits = int8_rows is not None and tuple(int8_rows[0].shape) == (M, K)
        q, d, t = int8_rows if fits else quantize_rows(x)
        block_m = triton.next_power_of_2(M)
        block_n, block_g, warps = config if config is not None and len(config) == 3 else (
            GEMV_LONG_K_CONFIG if K >= LONG_K else GEMV_CONFIG)[block_m]
        w = u.view(torch.int32)
        _qgemv_kernel[(triton.cdiv(N, block_n),)](q.view(torch.int32), d, t, w, words, y, M, N, K, NS, w.stride(0),
                                                  BITS=bits, GS=gs, BLOCK_M=block_m, BLOCK_N=block_n,
                                                  BLOCK_G=block_g,
                                                  EVEN=N % block_n == 0 and K // 32 % block_g == 0 and M == block_m,
                                                  EMU=INTERPRETED, ROUND=TL_DTYPES[x.dtype], num_warps=warps,
                                                  num_stages=1, **pdl_args(x.device))
        return y
    if M <= GEMM_ROWS:
        return qgemm(x, u, words, bits, y, config if tensor_cores else None, unpack)
    step = max(1, DEQUANT_BYTES // (K * x.element_size()))
    if N <= step:
        return torch.mm(x, dequantize(u, sm, bits, x.dtype).t(), out=y)
    for n0 in range(0, N, step):  # each slice's product straight into its columns (cuBLAS takes y's stride)
        rows = slice(n0, n0 + step)
        y[:, rows].addmm_(x, dequantize(u[rows], sm[rows], bits, x.dtype).t(), beta=0)
    return y


def sum_parts(part: torch.Tensor, y: torch.Tensor) -> None:
    """``y`` [M, N] = the sum over the float32 parts [SPLIT, M, N] a split-K product left."""
    split, mn = part.shape[0], y.numel()
    _split_sum_kernel[(triton.cdiv(mn, 1024),)](part, y, mn, SPLIT=split, BLOCK=1024, num_warps=4,
                                                **pdl_args(y.device))


def gemm_split(tiles: int, steps: int, per_sm: int, device: torch.device) -> int:
    """How many parts the tensor-core kernel splits K into: doubled while the programs number
    fewer than ``per_sm`` a multiprocessor and each part keeps two or more ``BLOCK_K`` steps."""
    split, want = 1, per_sm * multiprocessors(device)
    while tiles * split < want and steps >= 4 * split:
        split *= 2
    return split


def dequantize(u: torch.Tensor, sm: torch.Tensor, bits: int, dtype: torch.dtype,
               ids: torch.Tensor | None = None) -> torch.Tensor:
    """The packed rows ``u`` (scales ``sm``, as ``qlinear`` takes them) as a dense [N, K] weight
    of ``dtype``; with ``ids`` [T] (int64), only rows ``ids``, [T, K]: an embedding lookup in one
    launch (in torch ops it took a dozen small kernels a decode step)."""
    N = u.shape[0]
    K = u.shape[1] * 8 // bits
    rows = N if ids is None else ids.shape[0]
    w = torch.empty((rows, K), device=u.device, dtype=dtype)
    block_n, block_k, warps = DEQUANT_CONFIG if ids is None else GATHER_CONFIG
    words = scale_words(sm)
    _dequant_kernel[(triton.cdiv(rows, block_n), triton.cdiv(K, block_k))](  # no ids: a pointer never read
        u, words, w if ids is None else ids, w, rows, N, K, words.shape[1], u.stride(0), BITS=bits,
        GS=K // words.shape[1], BLOCK_N=block_n, BLOCK_K=block_k, GATHER=ids is not None, num_warps=warps,
        **pdl_args(u.device))
    return w


def reference_qlinear(x: torch.Tensor, u: torch.Tensor, sm: torch.Tensor, bits: int) -> torch.Tensor:
    """The same product in float32 torch ops (the weight dequantized whole)."""
    s, m = sm[..., 0], sm[..., 1]
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

