"""GPU kernels for packed weights (Triton): ``y = x W^T`` with ``W`` in the CPU kernel's layout
(``quant.PackedLinear``: 4-bit or 8-bit integers in groups of 32 along the input dimension,
``w = s * u + m`` per group, or per 16 for the K-quants), bfloat16 or float16 activations,
float32 accumulation.

- Up to ``GEMV_ROWS`` rows of ``x`` (decode) the product is memory-bound: ``_qgemv_kernel``
  gives each program ``BLOCK_N`` output features over the whole of K, in tiles shaped [rows,
  groups, 16] so that a group's scale and offset are loaded once and broadcast (a load per
  weight would make the kernel instruction-bound).
- Up to ``GEMM_ROWS`` rows (a batch of decodes) of a wide W (``WIDE_N`` rows and more: the
  MLP's gate and up, the vocabulary): ``_qgemm_kernel`` unpacks each tile of W once in registers
  and multiplies it on the tensor cores. A narrower W gives it too few tiles to fill the GPU
  (64 of 64 rows for 4096), so it is unpacked whole and cuBLAS multiplies, as for more rows.
- Otherwise (prefill): ``_dequant_kernel`` writes the weight to ``x``'s dtype in slices of rows
  and cuBLAS multiplies: the product is compute-bound there, and writing the weight once costs
  less than unpacking it in every tile of a GEMM.

4-bit weights in groups of 32 with bfloat16 activations take a faster road on GPUs that have
it (compute capability 8.0+): torch's tensor-core int4 kernel (``torch._weight_int4pack_mm``,
"tinygemm", the one gpt-fast uses) up to ``TC4_ROWS`` rows, from its own weight layout
(``Tc4Weight``); beyond that ``_tc4_dequant_kernel`` unpacks that layout to bf16 for cuBLAS. That
kernel holds scales and offsets as bfloat16s, so only weights whose scales are bfloat16s take
it (in-situ q4 makes them so, ``quant._q4_scales``); a GGUF's float16 scales keep the Triton
kernels, which compute them exactly.

Only basic ``tl`` operations, so the same source runs on Triton 3.6 on the GPU hosts and under
``TRITON_INTERPRET=1`` on a CPU, where the tests check it against the torch reference
``reference_qlinear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _group_tiles(u_ptr, s_ptr, m_ptr, n, k0, N, K, NS, BITS: tl.constexpr, GS: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """One K step of rows ``n`` of W: (lo, hi, s_lo, m_lo, s_hi, m_hi, k_lo, k_hi), where ``lo``
    and ``hi`` are float32 tiles [BLOCK_N, G, 16] of the integers at input indices ``k_lo`` and
    ``k_hi`` ([G, 16], G = BLOCK_K / 32 groups of 32) and s/m [BLOCK_N, G] their scales. A
    4-bit byte holds both: element j of a group in the low nibble, j + 16 in the high one."""
    G: tl.constexpr = BLOCK_K // 32
    g = k0 // 32 + tl.arange(0, G)
    j = tl.arange(0, 16)
    k_lo = g[:, None] * 32 + j[None, :]
    k_hi = k_lo + 16
    ok = (n[:, None, None] < N) & (g[None, :, None] < K // 32)
    row = n[:, None, None] * (K * BITS // 8)
    if BITS == 4:
        raw = tl.load(u_ptr + row + (g[:, None] * 16 + j[None, :])[None, :, :], mask=ok, other=0).to(tl.int32)
        lo = (raw & 15).to(tl.float32)
        hi = (raw >> 4).to(tl.float32)
    else:
        lo = tl.load(u_ptr + row + k_lo[None, :, :], mask=ok, other=0).to(tl.float32)
        hi = tl.load(u_ptr + row + k_hi[None, :, :], mask=ok, other=0).to(tl.float32)
    ok_s = (n[:, None] < N) & (g[None, :] < K // 32)
    at = n[:, None] * NS + g[None, :] * (32 // GS)
    s_lo = tl.load(s_ptr + at, mask=ok_s, other=0.0).to(tl.float32)
    m_lo = tl.load(m_ptr + at, mask=ok_s, other=0.0).to(tl.float32)
    if GS == 16:  # the K-quants: the high half of a group of 32 has its own scale
        s_hi = tl.load(s_ptr + at + 1, mask=ok_s, other=0.0).to(tl.float32)
        m_hi = tl.load(m_ptr + at + 1, mask=ok_s, other=0.0).to(tl.float32)
    else:
        s_hi = s_lo
        m_hi = m_lo
    return lo, hi, s_lo, m_lo, s_hi, m_hi, k_lo, k_hi


@triton.jit
def _load(at, ok, EVEN: tl.constexpr, POLICY: tl.constexpr):
    """``at`` where ``ok``, else 0; unmasked when the tiles divide the matrix (``EVEN``): a
    masked load zeroes its registers first, an instruction per element."""
    if EVEN:
        return tl.load(at, eviction_policy=POLICY)
    else:
        return tl.load(at, mask=ok, other=0, eviction_policy=POLICY)


@triton.jit
def _weight_tiles(u_ptr, s_ptr, m_ptr, n, g, in_k, ok, N, NS, stride_u, BITS: tl.constexpr, GS: tl.constexpr,
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
    ok_s = (n[:, None] < N) & in_k[None, :]
    at = n[:, None] * NS + g[None, :] * (32 // GS)
    s_lo = _load(s_ptr + at, ok_s, EVEN, "").to(tl.float32)[:, :, None]
    m_lo = _load(m_ptr + at, ok_s, EVEN, "").to(tl.float32)[:, :, None]
    if GS == 16:  # the K-quants: the high half of a group of 32 has its own scale
        s_hi = _load(s_ptr + at + 1, ok_s, EVEN, "").to(tl.float32)[:, :, None]
        m_hi = _load(m_ptr + at + 1, ok_s, EVEN, "").to(tl.float32)[:, :, None]
    else:
        s_hi = s_lo
        m_hi = m_lo
    return q_lo * s_lo + m_lo, q_hi * s_hi + m_hi


@triton.jit
def _qgemv_kernel(x_ptr, u_ptr, s_ptr, m_ptr, y_ptr, M, N, K, NS, stride_u,
                  BITS: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """Rows ``0..M-1`` of ``x`` (M <= BLOCK_M) times ``BLOCK_N`` packed rows of W, in tiles
    [rows of W, groups of 32, 16] (``_weight_tiles``).

    Every operand is loaded in the weight tile's own shape (``x`` with a zero stride over the
    rows of W) so that Triton gives them one register layout: a broadcast from a smaller tile
    would move it through shared memory at every step, and at 8 bits that cost more than the
    weights' own loads. With one row of ``x`` the products accumulate element-wise over the K
    steps and are summed once at the end; with more, each row's products are summed at every
    step (a tile per row would not fit the registers)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    G: tl.constexpr = BLOCK_K // 32
    j = tl.arange(0, 16)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, G, 16), dtype=tl.float32)
    acc_rows = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // 32 + tl.arange(0, G)
        in_k = g < K // 32
        ok = (n[:, None, None] < N) & in_k[None, :, None]
        w_lo, w_hi = _weight_tiles(u_ptr, s_ptr, m_ptr, n, g, in_k, ok, N, NS, stride_u, BITS, GS, EVEN,
                                   "evict_first")
        at_x = x_ptr + (g[:, None] * 32 + j[None, :])[None, :, :] + n[:, None, None] * 0
        if BLOCK_M == 1:
            x_lo = _load(at_x, ok, EVEN, "evict_last").to(tl.float32)
            x_hi = _load(at_x + 16, ok, EVEN, "evict_last").to(tl.float32)
            acc += x_lo * w_lo  # two statements: two fused multiply-adds, not a multiply and two adds
            acc += x_hi * w_hi
        else:
            for r in tl.static_range(BLOCK_M):
                ok_x = ok & (tl.full((1, 1, 1), r, tl.int32) < M)
                x_lo = _load(at_x + r * K, ok_x, False, "evict_last").to(tl.float32)
                x_hi = _load(at_x + r * K + 16, ok_x, False, "evict_last").to(tl.float32)
                part = tl.sum(tl.sum(x_lo * w_lo + x_hi * w_hi, axis=2), axis=1)
                acc_rows += tl.where(rm[:, None] == r, part[None, :], 0.0)
    if BLOCK_M == 1:
        acc_rows = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]
    tl.store(y_ptr + rm[:, None] * N + n[None, :], acc_rows.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (n[None, :] < N))


@triton.jit
def _qgemm_kernel(x_ptr, u_ptr, s_ptr, m_ptr, y_ptr, M, N, K, NS, stride_u,
                  BITS: tl.constexpr, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """A few dozen rows of ``x`` (a decode batch): each [BLOCK_N, BLOCK_K] tile of W is read
    once, unpacked to ``x``'s dtype in registers and multiplied on the tensor cores, the low
    and high halves of each group as two products (so no tile is interleaved)."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    G: tl.constexpr = BLOCK_K // 32
    j = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // 32 + tl.arange(0, G)
        in_k = g < K // 32
        ok = (n[:, None, None] < N) & in_k[None, :, None]
        w_lo, w_hi = _weight_tiles(u_ptr, s_ptr, m_ptr, n, g, in_k, ok, N, NS, stride_u, BITS, GS, False, "")
        dt = x_ptr.dtype.element_ty
        w_lo = tl.reshape(w_lo.to(dt), (BLOCK_N, BLOCK_K // 2))
        w_hi = tl.reshape(w_hi.to(dt), (BLOCK_N, BLOCK_K // 2))
        xm = (rm[:, None, None] < M) & in_k[None, :, None]
        at_x = x_ptr + rm[:, None, None] * K + (g[:, None] * 32 + j[None, :])[None, :, :]
        x_lo = tl.reshape(tl.load(at_x, mask=xm, other=0.0), (BLOCK_M, BLOCK_K // 2))
        x_hi = tl.reshape(tl.load(at_x + 16, mask=xm, other=0.0), (BLOCK_M, BLOCK_K // 2))
        if IEEE:
            acc += tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(x_lo, tl.trans(w_lo))
            acc += tl.dot(x_hi, tl.trans(w_hi))
    tl.store(y_ptr + rm[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (n[None, :] < N))


@triton.jit
def _dequant_kernel(u_ptr, s_ptr, m_ptr, w_ptr, N, K, NS, BITS: tl.constexpr, GS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``n`` of W as ``w_ptr``'s dtype, [N, K] row-major."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    lo, hi, s_lo, m_lo, s_hi, m_hi, k_lo, k_hi = _group_tiles(u_ptr, s_ptr, m_ptr, n, k0, N, K, NS, BITS, GS,
                                                              BLOCK_K)
    ok = (n[:, None, None] < N) & (k_lo[None, :, :] < K)
    row = w_ptr + n[:, None, None] * K
    out = w_ptr.dtype.element_ty
    tl.store(row + k_lo[None, :, :], (lo * s_lo[:, :, None] + m_lo[:, :, None]).to(out), mask=ok)
    tl.store(row + k_hi[None, :, :], (hi * s_hi[:, :, None] + m_hi[:, :, None]).to(out), mask=ok)


@triton.jit
def _tc4_dequant_kernel(p_ptr, sz_ptr, ids_ptr, w_ptr, R, N, K, IKT: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """Rows ``ids`` of a ``Tc4Weight`` as ``w_ptr``'s dtype, [R, K] row-major. Nibble ``p`` of
    word ``[n // 8][k // (16 IKT)][t][i]`` holds element ``(n, k)`` with ``t = 4 (n % 8) + (k % 8)
    // 2``, ``i = (k % (16 IKT)) // 32`` and ``p = 4 (k % 2) + 2 ((k % 32) // 16) + (k % 16) // 8``
    (the B operand of the m16n8k16 tensor-core product, two k-tiles to a word)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n = tl.load(ids_ptr + r, mask=r < R, other=0)
    ok = (r[:, None] < R) & (k[None, :] < K)
    kr = k % (16 * IKT)
    t = (n % 8)[:, None] * 4 + ((k % 8) // 2)[None, :]
    word = (((n // 8)[:, None] * (K // (16 * IKT)) + (k // (16 * IKT))[None, :]) * 32 + t) * (IKT // 2) + (kr // 32)[None, :]
    nibble = 4 * (k % 2) + 2 * ((kr % 32) // 16) + (k % 16) // 8
    q = (tl.load(p_ptr + word, mask=ok, other=0) >> (4 * nibble)[None, :]) & 15
    at = ((k // 32)[None, :] * N + n[:, None]) * 2
    scale = tl.load(sz_ptr + at, mask=ok, other=0.0).to(tl.float32)
    zero = tl.load(sz_ptr + at + 1, mask=ok, other=0.0).to(tl.float32)
    w = (q - 8).to(tl.float32) * scale + zero
    tl.store(w_ptr + r[:, None] * K + k[None, :], w.to(w_ptr.dtype.element_ty), mask=ok)


# (BLOCK_N, BLOCK_K, num_warps) of the decode kernel by rows of x rounded up to a power of two,
# and for one row of a matrix of at least WIDE_N rows; overridable for tuning
# (scripts/bench-qlinear --sweep, measured on an H200).
GEMV_CONFIG = {1: (2, 1024, 2), 2: (2, 1024, 1), 4: (2, 512, 1), 8: (2, 512, 1)}
GEMV_WIDE_CONFIG = (2, 512, 1)
WIDE_N = 16384
GEMV_ROWS = 4  # more rows than this: the tensor-core kernel
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the tensor-core kernel by rows of x
GEMM_CONFIG = {16: (16, 64, 128, 4, 3), 32: (32, 64, 128, 4, 3)}
GEMM_ROWS = 32  # more rows than this, or fewer than WIDE_N rows of W: dequantize and cuBLAS
DEQUANT_CONFIG = (8, 512, 4)  # BLOCK_N, BLOCK_K, num_warps
DEQUANT_ROWS = 8192  # rows of W unpacked at a time


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
    if M <= GEMV_ROWS:
        block_m = triton.next_power_of_2(M)
        block_n, block_k, warps = GEMV_WIDE_CONFIG if block_m == 1 and N >= WIDE_N else GEMV_CONFIG[block_m]
        _qgemv_kernel[(triton.cdiv(N, block_n),)](x, u, s, m, y, M, N, K, NS, u.stride(0), BITS=bits, GS=gs,
                                                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                                  EVEN=N % block_n == 0 and K % block_k == 0, num_warps=warps,
                                                  num_stages=1)
        return y
    if M <= GEMM_ROWS and N >= WIDE_N:
        block_m, block_n, block_k, warps, stages = GEMM_CONFIG[max(16, triton.next_power_of_2(M))]
        _qgemm_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
            x, u, s, m, y, M, N, K, NS, u.stride(0), BITS=bits, GS=gs, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
        return y
    for n0 in range(0, N, DEQUANT_ROWS):
        rows = slice(n0, n0 + DEQUANT_ROWS)
        y[:, rows] = x @ dequantize(u[rows], s[rows], m[rows], bits, x.dtype).t()
    return y


def dequantize(u: torch.Tensor, s: torch.Tensor, m: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The packed rows ``u`` as a dense [N, K] weight of ``dtype``."""
    N = u.shape[0]
    K = u.shape[1] * 8 // bits
    w = torch.empty((N, K), device=u.device, dtype=dtype)
    block_n, block_k, warps = DEQUANT_CONFIG
    _dequant_kernel[(triton.cdiv(N, block_n), triton.cdiv(K, block_k))](
        u, s, m, w, N, K, s.shape[1], BITS=bits, GS=K // s.shape[1], BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps)
    return w


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


# ------------------------------------------------------------------------- tensor-core int4

TC4_ROWS = 32  # more rows than this: unpack to bf16 and cuBLAS
TC4_DEQUANT_CONFIG = (8, 256, 4)  # BLOCK_R, BLOCK_K, num_warps


class Tc4Weight:
    """A 4-bit weight in groups of 32 in the layout of ``torch._weight_int4pack_mm``: ``packed``
    int32 [N/8, K/(16 IKT), 32, IKT/2], ``sz`` bf16 [K/32, N, 2] with ``w = (q - 8) * scale +
    zero`` per group (so ``zero = m + 8 s`` for our ``w = s q + m``)."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, n: int, k: int) -> None:
        self.packed, self.sz, self.n, self.k = packed, sz, n, k
        self.ikt = packed.shape[3] * 2

    @staticmethod
    def fits(n: int, k: int, group: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (device.type == "cuda" and dtype == torch.bfloat16 and group == 32 and n % 8 == 0 and k % 32 == 0
                and torch.cuda.get_device_capability(device) >= (8, 0))

    @classmethod
    def build(cls, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, pack=None) -> Tc4Weight:
        """``q`` uint8 values 0..15 [N, K], ``s``, ``m`` float [N, K/32], all on one device;
        ``pack`` packs the nibbles (torch's own converter on a GPU, ``reference_tc4_pack``
        elsewhere)."""
        N, K = q.shape
        ikt = 8 if K % 128 == 0 else 4 if K % 64 == 0 else 2
        if pack is None:
            packed = torch._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).contiguous(), ikt)
        else:
            packed = pack(q, ikt)
        s, m = s.float(), m.float()
        sz = torch.stack([s, m + 8 * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return cls(packed, sz, N, K)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.sz]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` bf16 [M, K] -> [M, N]."""
        if x.shape[0] <= TC4_ROWS:
            return torch._weight_int4pack_mm(x.contiguous(), self.packed, 32, self.sz)
        y = torch.empty((x.shape[0], self.n), device=x.device, dtype=x.dtype)
        ids = torch.arange(self.n, device=x.device, dtype=torch.int32)
        for n0 in range(0, self.n, DEQUANT_ROWS):
            part = ids[n0:n0 + DEQUANT_ROWS]
            y[:, n0:n0 + len(part)] = x @ self.rows(part, x.dtype).t()
        return y

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of W, dequantized [len(ids), K]."""
        R = ids.shape[0]
        w = torch.empty((R, self.k), device=self.packed.device, dtype=dtype)
        block_r, block_k, warps = TC4_DEQUANT_CONFIG
        _tc4_dequant_kernel[(triton.cdiv(R, block_r), triton.cdiv(self.k, block_k))](
            self.packed, self.sz, ids.to(torch.int32).contiguous(), w, R, self.n, self.k, IKT=self.ikt,
            BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps)
        return w


def reference_tc4_pack(q: torch.Tensor, ikt: int) -> torch.Tensor:
    """What ``torch._convert_weight_to_int4pack`` makes of values 0..15 [N, K] (N % 8 == 0), in
    torch ops: word ``[n // 8][k // (16 ikt)][t][i]``, nibble ``p``, as ``_tc4_dequant_kernel``
    reads it. The GPU test checks it against torch's own converter."""
    N, K = q.shape
    # q[nT, a, kO, i, jh, jl, b, lo] with n = 8 nT + a, k = 16 ikt kO + 32 i + 16 jh + 8 jl + 2 b + lo
    v = q.to(torch.int64).reshape(N // 8, 8, K // (16 * ikt), ikt // 2, 2, 2, 4, 2)
    # -> [nT, kO, t = 4 a + b, i, nibble = 4 lo + 2 jh + jl]
    v = v.permute(0, 2, 1, 6, 3, 7, 4, 5).reshape(N // 8, K // (16 * ikt), 32, ikt // 2, 8)
    words = (v << (4 * torch.arange(8, device=q.device))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
