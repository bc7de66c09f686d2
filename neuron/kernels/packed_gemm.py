"""The tensor-core product of packed weights for a batch of decodes or a short prompt
(``packed.GEMV_ROWS`` < rows <= ``GEMM_ROWS``): ``y = x W^T`` with W in
``packed_linear.PackedLinear``'s layout (4- or 8-bit integers in groups of 32 along K,
``w = s * u + m`` per group; byte j of a 4-bit group holds element j in its low nibble and j + 16
in its high one).

The product is computed transposed, ``y^T = W x^T``: a tile of W is the MMA's first operand,
which Hopper's ``wgmma`` takes from registers, so W is unpacked in registers and never written to
shared memory; the batch's rows are the MMA's narrow side (16 to 64), which ``wgmma`` allows
where a first operand of so few rows would waste most of each instruction.

Unpacking a 4-bit W takes a few instructions per pair of weights (``_asm``: a nibble OR-ed into
the mantissa of a float is that float plus the nibble, exactly, as Marlin's kernels do), instead
of a conversion and a float32 multiply-add per weight. The registers of an MMA operand hold
pairs of neighbours along K (columns 2c, 2c+1 of a row, then 2c+8, 2c+9), which are neighbouring
bytes of a group's half: the tile keeps K's own order, so x's tile goes from memory to shared
memory as it is (``cp.async``, no pass through registers) and the compiler keeps the MMAs of a
step in flight while the next step's W is unpacked (a permuted order cost a copy of x's tile
through registers a step and a wait after each MMA).

A few rows over a narrow W make too few tiles to keep the memory system busy, so K is split in
parts (``split``); each part leaves its float32 sum in a buffer, and the last part of a tile to
finish (counted in ``split_counters``) adds them in a fixed order and stores y: one launch, and the same
sums whichever part finishes last.

Under Triton's interpreter (``TRITON_INTERPRET=1``: no inline assembly) and for 8-bit W, the
K-quants' half-group scales, or float32 activations, W is unpacked with float operations
instead.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import INTERPRETED, grid_sync, multiprocessors, pdl_args


def _asm(magic: str, one: str, split: bool) -> str:
    """Four bytes of a 4-bit W ($4) as eight 16-bit floats, each ``(q - c) s + r`` rounded once
    (``group_operands``: a word of each byte's for each of ``-(magic + c)`` $5..$8, the scale's
    high part $9..$12, its low part $13..$16 and ``r`` $17..$20, two of it): the low nibbles of
    bytes 0, 1 in $0 and 2, 3 in $1, the high nibbles so in $2 and $3. Bytes 0 and 1 are of one row
    of W, and 2 and 3 (of the MMA operand's layout, whose registers come in pairs along K), not all
    four. Two bytes are spread to the halves of a word (``prmt``); a nibble OR-ed into the mantissa
    of ``magic`` (128 in bfloat16, 1024 in float16) is that float plus the nibble, exactly, as
    Marlin's kernels do; an FMA takes ``magic + c`` off, exactly (``d = q - c``, a small integer).
    With ``split`` (a scale the 16-bit type does not hold: AWQ's and GGUF's float16 scales in
    bfloat16) ``p = d s_lo + r`` is exact (r = 0 for a zero point, ``d s_lo`` of few bits) and the
    last FMA rounds ``d s_hi + p`` once; without, ``d s + r`` is rounded once: either way the
    weight that the exact ``q s + m`` rounds to, with no scale or offset rounded on the way."""
    lines = []
    for pair, selector in ((0, "0x4140"), (1, "0x4342")):
        lines.append(f"prmt.b32 t, $4, 0, {selector};")
        for out, src in ((pair, "t"), (2 + pair, "h")):
            if src == "h":
                lines.append("shr.u32 h, t, 4;")
            lines.append(f"lop3.b32 v, {src}, 0x000F000F, {magic}, 0xEA;")
            lines.append(f"fma.rn.{{T}}x2 v, v, one, ${5 + 2 * pair};")
            if split:
                lines.append(f"fma.rn.{{T}}x2 p, v, ${13 + 2 * pair}, ${17 + 2 * pair};")
                lines.append(f"fma.rn.{{T}}x2 ${out}, v, ${9 + 2 * pair}, p;")
            else:
                lines.append(f"fma.rn.{{T}}x2 ${out}, v, ${9 + 2 * pair}, ${17 + 2 * pair};")
    return f"{{ .reg .b32 t, h, v, p, one; mov.b32 one, {one}; " + " ".join(lines) + " }"


_ASM_BF16 = tl.constexpr(_asm("0x43004300", "0x3F803F80", False).replace("{T}", "bf16"))
_ASM_F16 = tl.constexpr(_asm("0x64006400", "0x3C003C00", False).replace("{T}", "f16"))
_ASM_BF16_SPLIT = tl.constexpr(_asm("0x43004300", "0x3F803F80", True).replace("{T}", "bf16"))
_ASM_F16_SPLIT = tl.constexpr(_asm("0x64006400", "0x3C003C00", True).replace("{T}", "f16"))
_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 17))
# Four bytes of an 8-bit W ($2) as four 16-bit floats ($0: bytes 0, 1; $1: 2, 3) times their
# scales ($3..$6) plus their offsets ($7..$10). bfloat16 has too few mantissa bits for a byte, so
# a byte goes into a float32 (2^23 + byte, exactly), is scaled there and rounded in pairs;
# float16 holds 1024 + byte, as the 4-bit kernel's nibbles (the scales then come as pairs).
_ASM8_BF16 = tl.constexpr(
    "{ .reg .b32 k, a; .reg .f32 f0, f1, f2, f3; mov.b32 k, 0x4B000000; "
    + " ".join(f"prmt.b32 a, $2, k, 0x765{e}; mov.b32 f{e}, a; sub.rn.f32 f{e}, f{e}, 0f4B000000; "
               f"fma.rn.f32 f{e}, f{e}, ${3 + e}, ${7 + e};" for e in range(4))
    + " cvt.rn.bf16x2.f32 $0, f1, f0; cvt.rn.bf16x2.f32 $1, f3, f2; }")
_ASM8_F16 = tl.constexpr(
    "{ .reg .b32 k, v, one, minus; mov.b32 k, 0x64646464; mov.b32 one, 0x3C003C00; mov.b32 minus, 0xE400E400; "
    "prmt.b32 v, $2, k, 0x4140; fma.rn.f16x2 v, v, one, minus; fma.rn.f16x2 $0, v, $3, $7; "
    "prmt.b32 v, $2, k, 0x4342; fma.rn.f16x2 v, v, one, minus; fma.rn.f16x2 $1, v, $5, $9; }")
_CONSTRAINTS8 = tl.constexpr("=r,=r," + ",".join(["r"] * 9))


@triton.jit
def _scale_pairs(word, dt: tl.constexpr):
    """A group's scale and offset (``pair_scales``' word) as two int32 words that hold each twice
    in ``dt`` (bf16x2 or f16x2 operands of ``_asm``): two instructions each from float16 to
    bfloat16, one from float32; from float16 to float16 a byte permutation."""
    if word.dtype == tl.int64:
        s, m = unpair(word)
        if dt == tl.bfloat16:
            return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $2; cvt.rn.bf16x2.f32 $1, $3, $3;",
                                             "=r,=r,r,r", [s, m], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $2; cvt.rn.f16x2.f32 $1, $3, $3;",
                                             "=r,=r,r,r", [s, m], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    elif dt == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 a, b; .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 a, lo; cvt.f32.f16 b, hi; "
            "cvt.rn.bf16x2.f32 $0, a, a; cvt.rn.bf16x2.f32 $1, b, b; }",
            "=r,=r,r", [word], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $2, 0, 0x1010; prmt.b32 $1, $2, 0, 0x3232;", "=r,=r,r",
                                         [word], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def group_operands(word, dt: tl.constexpr):
    """A 4-bit group's scale ``s`` and offset ``m`` (``pair_scales``' word) as ``_asm``'s four
    operands, each an int32 word holding it twice in ``dt``: ``-(magic + c)``, ``s_hi``, ``s_lo``
    and ``r``, with ``s = s_hi + s_lo`` exactly (a float16 scale is a bfloat16 and three bits
    more) and ``q s + m = (q - c) s + r``. Float32 pairs (AWQ's and GPTQ's ``m = -s z``): ``c`` is
    the zero point ``z``, ``r = 0``. Float16 pairs: ``c = 8``, so ``r = m + 8 s`` is 0 for Q4_0 and
    the weight at q = 8 for in-situ q4 (a bfloat16 by construction: ``quant._q4_scales``); Q4_1's
    arbitrary minimum leaves an ``r`` rounded to ``dt``, off by at most 2^-9 of it."""
    s, m = unpair(word)
    magic = 128.0 if dt == tl.bfloat16 else 1024.0
    if word.dtype == tl.int64:
        safe = tl.where(s == 0, 1.0, s)
        ratio = tl.inline_asm_elementwise("div.full.f32 $0, $1, $2;", "=r,r,r", [-m, safe], dtype=tl.float32,
                                          is_pure=True, pack=1)
        c = tl.where(s == 0, 0.0, tl.minimum(tl.maximum(tl.floor(ratio + 0.5), -112.0), 112.0))
    else:
        c = tl.full(s.shape, 8.0, tl.float32)
    r = m + c * s
    s_hi = s.to(dt).to(tl.float32)
    if dt == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "cvt.rn.bf16x2.f32 $0, $4, $4; cvt.rn.bf16x2.f32 $1, $5, $5; cvt.rn.bf16x2.f32 $2, $6, $6; "
            "cvt.rn.bf16x2.f32 $3, $7, $7;", "=r,=r,=r,=r,r,r,r,r", [-(magic + c), s_hi, s - s_hi, r],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $4, $4; cvt.rn.f16x2.f32 $1, $5, $5; cvt.rn.f16x2.f32 $2, $6, $6; "
            "cvt.rn.f16x2.f32 $3, $7, $7;", "=r,=r,=r,=r,r,r,r,r", [-(magic + c), s_hi, s - s_hi, r],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def unpair(word):
    """A scale and an offset from the word that holds both (``pair_scales``): two float16 in an
    int32 word, or two float32 in an int64 one; as float32."""
    if word.dtype == tl.int64:
        s = word.to(tl.int32).to(tl.float32, bitcast=True)
        m = (word >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        s = word.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        m = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return s, m


@triton.jit
def _load(at, ok, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(at)
    else:
        return tl.load(at, mask=ok, other=0)


@triton.jit
def weight_tile(u_ptr, sm_ptr, n, g, N, K, NS, stride_u, dt: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                ASM: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr):
    """Rows ``n`` of W at groups ``g`` as a ``dt`` tile [rows, groups * 32], in K's order: each
    weight the exact ``s q + m`` rounded once to ``dt``. ``SPLIT``: the scales are not all exact
    in ``dt`` (``_asm``)."""
    j = tl.arange(0, 16)
    at = u_ptr + n[:, None, None] * stride_u + (g[:, None] * (4 * BITS) + j[None, :])[None, :, :]
    ok = (n[:, None, None] < N) & (g < K // 32)[None, :, None]
    raw = _load(at, ok, EVEN)
    if GS <= 32:
        sat = sm_ptr + n[:, None] * NS + g[None, :] * (32 // GS)
    else:
        sat = sm_ptr + n[:, None] * NS + g[None, :] // (GS // 32)
    okg = (n[:, None] < N) & (g < K // 32)[None, :]
    word = _load(sat, okg, EVEN)
    if ASM and BITS == 8:
        if dt == tl.bfloat16:  # scaled in float32 (_ASM8_BF16)
            s_w, m_w = unpair(word)
        else:
            s_w, m_w = _scale_pairs(word, dt)
        sb = tl.broadcast_to(s_w[:, :, None], raw.shape)
        mb = tl.broadcast_to(m_w[:, :, None], raw.shape)
        w_lo = _unpack8(raw, sb, mb, dt)
        w_hi = _unpack8(_load(at + 16, ok, EVEN), sb, mb, dt)
    elif ASM:
        negc, s_hi, s_lo, r = group_operands(word, dt)
        ops = [raw, tl.broadcast_to(negc[:, :, None], raw.shape), tl.broadcast_to(s_hi[:, :, None], raw.shape),
               tl.broadcast_to(s_lo[:, :, None], raw.shape), tl.broadcast_to(r[:, :, None], raw.shape)]
        if dt == tl.bfloat16 and SPLIT:
            w_lo, w_hi = tl.inline_asm_elementwise(_ASM_BF16_SPLIT, _CONSTRAINTS, ops,
                                                   dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        elif dt == tl.bfloat16:
            w_lo, w_hi = tl.inline_asm_elementwise(_ASM_BF16, _CONSTRAINTS, ops, dtype=(tl.bfloat16, tl.bfloat16),
                                                   is_pure=True, pack=4)
        elif SPLIT:
            w_lo, w_hi = tl.inline_asm_elementwise(_ASM_F16_SPLIT, _CONSTRAINTS, ops, dtype=(tl.float16, tl.float16),
                                                   is_pure=True, pack=4)
        else:
            w_lo, w_hi = tl.inline_asm_elementwise(_ASM_F16, _CONSTRAINTS, ops, dtype=(tl.float16, tl.float16),
                                                   is_pure=True, pack=4)
    else:
        s_lo, m_lo = unpair(word)
        if BITS == 8:
            q_lo = raw
            q_hi = _load(at + 16, ok, EVEN)
        else:
            q_lo = raw & 15
            q_hi = raw >> 4
        if GS == 16:
            s_hi, m_hi = unpair(_load(sat + 1, okg, EVEN))
        else:
            s_hi = s_lo
            m_hi = m_lo
        # in float32, rounded once to ``dt``: the weight the exact ``q s + m`` rounds to
        w_lo = (q_lo.to(tl.float32) * s_lo[:, :, None] + m_lo[:, :, None]).to(dt)
        w_hi = (q_hi.to(tl.float32) * s_hi[:, :, None] + m_hi[:, :, None]).to(dt)
    rows: tl.constexpr = raw.shape[0]
    cols: tl.constexpr = raw.shape[1] * 32
    return tl.reshape(tl.permute(tl.join(w_lo, w_hi), (0, 1, 3, 2)), (rows, cols))


@triton.jit
def _unpack8(raw, sb, mb, dt: tl.constexpr):
    if dt == tl.bfloat16:
        return tl.inline_asm_elementwise(_ASM8_BF16, _CONSTRAINTS8, [raw, sb, mb], dtype=tl.bfloat16, is_pure=True,
                                         pack=4)
    else:
        return tl.inline_asm_elementwise(_ASM8_F16, _CONSTRAINTS8, [raw, sb, mb], dtype=tl.float16, is_pure=True,
                                         pack=4)


@triton.jit(do_not_specialize=["M"])
def _qgemm_kernel(x_ptr, u_ptr, sm_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, NS, stride_u, STEPS, SPLIT,
                  BITS: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr,
                  SPLIT_S: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j, s): rows ``i * BLOCK_N ..`` of W (of y^T) times rows ``j * BLOCK_M ..`` of x,
    over ``STEPS`` steps of ``BLOCK_K`` columns from step ``s * STEPS``; with ``SPLIT_K`` (``SPLIT`` > 1) its
    float32 sum goes to ``part_ptr`` [SPLIT, M, N] and the tile's last part adds them up
    (``lock_ptr``: a counter per tile, zero between launches)."""
    grid_sync(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dt: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    first = pid_s * STEPS  # counted in steps: the compiler then knows k0 % BLOCK_K == 0 (16-byte copies)
    for step in range(first, tl.minimum(first + STEPS, tl.cdiv(K, BLOCK_K))):
        k0 = step * BLOCK_K
        g = step * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        w = weight_tile(u_ptr, sm_ptr, n, g, N, K, NS, stride_u, dt, BITS, GS, ASM, EVEN, SPLIT_S)
        kk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + rm[None, :] * K + kk[:, None], mask=(rm[None, :] < M) & (kk[:, None] < K), other=0.0)
        if dt == tl.float32:
            acc += tl.dot(w, xt, input_precision="ieee")
        else:
            acc += tl.dot(w, xt)
    mn = rm[None, :] * N + n[:, None]
    out = (rm[None, :] < M) & (n[:, None] < N)
    if not SPLIT_K:
        tl.store(y_ptr + mn, acc.to(y_ptr.dtype.element_ty), mask=out)
    else:
        tl.store(part_ptr + pid_s * M * N + mn, acc, mask=out)
        tile = pid_m * tl.num_programs(0) + pid_n
        tl.debug_barrier()  # every thread's part stored before the count says so
        if tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.load(part_ptr + mn, mask=out, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT):
                total += tl.load(part_ptr + s * M * N + mn, mask=out, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + mn, total.to(y_ptr.dtype.element_ty), mask=out)
            tl.atomic_xchg(lock_ptr + tile, 0)


LOCKS = 1 << 16  # tiles a split product may have (the LM head of a 152k vocabulary at 64 rows: 2,374)


@functools.cache
def _counters(device: torch.device, stream: int) -> torch.Tensor:
    return torch.zeros(LOCKS, dtype=torch.int32, device=device)


def split_counters(device: torch.device) -> torch.Tensor:
    """The split parts' counters of the stream that launches (products on two streams at once
    would otherwise count each other's parts); a CUDA graph keeps those of the stream it was
    captured on, and its replays run one at a time."""
    return _counters(device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)


# (BLOCK_N, BLOCK_K, num_warps, num_stages) by BLOCK_M (the rows of x rounded up to a power of two,
# at least 16), where the load-time tuner measured none faster (runner/linear.GEMM_CANDIDATES),
# and how many programs a multiprocessor the split of K aims at, by BLOCK_M (H200, splits 1-16 as
# scripts/bench-qlinear --sweep-kinds gemm tries them, Qwen3-8B's q/k/v, o and down: at 64 rows
# twice the parts cost 13-35% more, at 32 rows they won).
GEMM_CONFIG = {16: (128, 128, 8, 3), 32: (128, 64, 8, 3), 64: (128, 64, 8, 3)}
GEMM_PROGRAMS_PER_SM = {16: 2, 32: 2, 64: 1}
# More rows than this: W unpacked for cuBLAS. Past 64 rows x is taken in tiles of 64 rows; a layer
# of Qwen3-8B's four products at 4 bits (H200, us; scripts/bench-qlinear --rows 96,128,256 with
# --gemm-rows 64, then 256, times the two): 96 rows 215.6 here against 257.0
# unpacked for cuBLAS (bf16 119.0), 128 rows 215.6 against 259.7, 256 rows 407.8 against 286.0.
GEMM_ROWS = 128
GEMM_SPLIT: int | None = None  # a fixed split of K (tests, benchmarks), else the config's or split_for's


def split_for(tiles: int, steps: int, block_m: int, device: torch.device) -> int:
    """How many parts K is split into: doubled while the programs number fewer than
    ``GEMM_PROGRAMS_PER_SM`` a multiprocessor and each part keeps two or more ``BLOCK_K`` steps."""
    split, want = 1, GEMM_PROGRAMS_PER_SM[block_m] * multiprocessors(device)
    while tiles * split < want and steps >= 4 * split and tiles * split * 2 <= LOCKS:
        split *= 2
    return split


def default_split(N: int, M: int, K: int, config: tuple[int, ...], device: torch.device) -> int:
    """``split_for``'s parts for a product of ``config``'s tiles (its first two: BLOCK_N, BLOCK_K)."""
    block_m = min(max(16, triton.next_power_of_2(M)), max(GEMM_CONFIG))
    return split_for(triton.cdiv(N, config[0]) * triton.cdiv(M, block_m), triton.cdiv(K, config[1]), block_m, device)


def qgemm(x: torch.Tensor, u: torch.Tensor, words: torch.Tensor, bits: int, y: torch.Tensor,
          config: tuple[int, ...] | None = None, unpack: str = "split") -> torch.Tensor:
    """``y`` [M, N] = ``x`` [M, K] times the packed W (``u`` [N, K * bits / 8], ``words``: its
    scales as ``scale_words`` gives them) transposed; ``config``: (BLOCK_N, BLOCK_K, num_warps,
    num_stages), and optionally the parts K is split into (else ``split_for``'s), else
    ``GEMM_CONFIG``'s for M rows. ``unpack``: "fast", "split" or "float", as
    ``packed_scales.unpack_modes`` gives it for W and x's dtype ("split" is exact for zero points
    and in-situ q4, a fraction of an ulp off for arbitrary offsets)."""
    M, K = x.shape
    N = u.shape[0]
    NS = words.shape[1]
    gs = K // NS
    block_m = min(max(16, triton.next_power_of_2(M)), max(GEMM_CONFIG))  # more rows: tiles of them
    config = config or GEMM_CONFIG[block_m]
    block_n, block_k, warps, stages = config[:4]
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    steps = triton.cdiv(K, block_k)
    split = GEMM_SPLIT or (config[4] if len(config) > 4 else split_for(tiles, steps, block_m, x.device))
    split = min(split, steps)
    assert split == 1 or tiles <= LOCKS, (tiles, LOCKS)
    part = torch.empty((split, M, N), device=x.device, dtype=torch.float32) if split > 1 else y
    asm = not INTERPRETED and gs >= 32 and x.dtype in (torch.bfloat16, torch.float16) and unpack != "float"
    _qgemm_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m), split)](
        x, u, words, y, part, split_counters(x.device), M, N, K, NS, u.stride(0), triton.cdiv(steps, split), split, BITS=bits,
        GS=gs, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split > 1, ASM=asm,
        EVEN=N % block_n == 0 and K % block_k == 0, SPLIT_S=unpack == "split", num_warps=warps, num_stages=stages,
        **pdl_args(x.device))
    return y
