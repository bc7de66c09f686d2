"""The small fused ops of the GPU step (Triton): RMS norm with the residual add (and the
tensor-parallel sum before it, over peer memory), q/k norm + RoPE with the KV store, SiLU·mul;
each may also write its output's int8 rows for a packed product. Checked against
neuron/models/ops.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .int8_rows import int8_rows_buffers, quantize_groups
from .launch import grid_sync, pdl_args, pow2


# ---------------------------------------------------------------------------------------------
# RMS norm, optionally fused with the residual add that precedes it.


@triton.jit
def _rms_norm_kernel(X, R, W, Out, RNew, Q, D, S, Peers, Gens, rank, slot_rows, stride_x, stride_r,
                     stride_o, eps, N: tl.constexpr, N_PAD: tl.constexpr, ADD: tl.constexpr, QUANT: tl.constexpr,
                     WORLD: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, N_PAD)
    mask = i < N
    w = tl.load(W + i, mask=mask, other=0.0)  # a weight: no kernel writes it
    grid_sync(PDL)
    x = tl.load(X + row * stride_x + i, mask=mask, other=0.0)
    if WORLD > 1:  # x is this rank's part: the sum over the ranks first
        x = _peer_sum(x, X.dtype.element_ty, BITS, row, i, mask, Peers, Gens, rank, slot_rows, N, WORLD)
    if ADD:
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + i, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(RNew + row * stride_r + i, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    out = (w.to(tl.float32) * h.to(x.dtype).to(tl.float32)).to(x.dtype)
    tl.store(Out + row * stride_o + i, out, mask=mask)
    if QUANT:  # the packed projection that follows multiplies these as int8 groups of 32
        g = tl.arange(0, N_PAD // 32)
        quantize_groups(tl.reshape(out.to(tl.float32), (N_PAD // 32, 2, 16)), g, g < N // 32, Q + row * N,
                         D + row * (N // 32), S + row * (N // 16))


@triton.jit
def _peer_sum(x, dtype, bits, row, i, mask, Peers, Gens, rank, slot_rows, N: tl.constexpr, WORLD: tl.constexpr):
    """Row ``row`` of x summed over the ranks through their GPUs' peer memory (NVLink), in rank
    order, so that every rank gets the same bits. ``Peers`` holds each rank's symmetric buffer of
    three slots of rows, each row a part per rank, every element -0.0 while unwritten. A row's
    program has a generation ``g`` (``Gens``, this rank's memory), the count of its earlier sums,
    the same on every rank since every rank runs the same steps. It stores its part (-0.0 made
    +0.0) into slot ``g % 3`` of every rank's buffer, then waits until no element of its own
    buffer's parts is -0.0 and adds them: the data is its own flag, so a sum costs one one-way
    trip over NVLink and no fence. It clears slot ``(g + 2) % 3``, which held ``g - 1``: every
    rank's part of that arrived before this rank finished ``g - 1``, and no rank writes it again
    before ``g + 2``, which needs this rank's part of ``g + 1``, stored by a later kernel."""
    g = tl.load(Gens + row)
    unset: tl.constexpr = -(1 << (dtype.primitive_bitwidth - 1))  # -0.0's bits
    x = tl.where(x.to(bits, bitcast=True) == unset, tl.zeros_like(x), x)
    here = ((g % 3) * slot_rows + row) * WORLD * N
    for p in tl.static_range(WORLD):
        peer = tl.multiple_of(tl.load(Peers + p).to(tl.pointer_type(dtype)), 16)
        tl.store(peer + here + rank * N + i, x, mask=mask)
    mine = tl.multiple_of(tl.load(Peers + rank).to(tl.pointer_type(dtype)), 16)
    acc = tl.zeros((x.shape[0],), dtype=tl.float32)
    for p in tl.static_range(WORLD):
        part = tl.load(mine + here + p * N + i, mask=mask, other=0.0, volatile=True)
        while tl.sum(((part.to(bits, bitcast=True) == unset) & mask).to(tl.int32), 0) > 0:
            part = tl.load(mine + here + p * N + i, mask=mask, other=0.0, volatile=True)
        acc += part.to(tl.float32)
    done = (((g + 2) % 3) * slot_rows + row) * WORLD * N
    for p in tl.static_range(WORLD):
        tl.store(mine + done + p * N + i, tl.full(x.shape, unset, bits).to(dtype, bitcast=True), mask=mask)
    tl.store(Gens + row, g + 1)
    return acc.to(dtype)


_BITS = {2: tl.int16, 4: tl.int32}  # the integers that hold a float's bits, by its bytes


def _int8_rows(out: torch.Tensor, quantize: bool) -> tuple[torch.Tensor, ...]:
    """The buffers of ``out``'s int8 form, attached to it as ``out.int8_rows`` (which a packed
    projection reads in place of quantizing ``out`` itself); ``out`` thrice when not wanted."""
    if not quantize:
        return out, out, out
    out.int8_rows = int8_rows_buffers(*out.shape, out.device)
    return out.int8_rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quantize: bool = False, peers=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """norm(x) or, with ``residual``, (norm(residual + x), residual + x) — the sum written into
    ``residual`` in place. Rows of x [T, N] must be contiguous. ``quantize`` (N a multiple of 32):
    the output's int8 form too (``_int8_rows``). ``peers`` (a ``models.layers.PeerRows`` of at
    least T rows of N): x is this rank's part of a tensor-parallel sum, taken first over the
    GPUs' peer memory; every rank of the group must make the same calls."""
    T, N = x.shape
    out = torch.empty_like(x)
    add = residual is not None
    r = residual if add else x
    peer = (x, x, 0, 0) if peers is None else (peers.ptrs, peers.gens, peers.rank, peers.rows)
    _rms_norm_kernel[(T,)](x, r, weight, out, r, *_int8_rows(out, quantize), *peer, x.stride(0), r.stride(0),
                           out.stride(0), eps, N=N, N_PAD=pow2(N), ADD=add, QUANT=quantize,
                           WORLD=1 if peers is None else peers.world, BITS=_BITS[x.element_size()],
                           num_warps=8 if N >= 2048 else 4, **pdl_args(x.device))
    return out, residual


# ---------------------------------------------------------------------------------------------
# q/k/v of a step: the optional per-head RMS norm (qwen3) and RoPE ("rotate half") of q and k; q
# rotated in place, k and v written straight into their cache rows (one launch per layer).


@triton.jit(do_not_specialize=["T"])
def _rope_store_kernel(X, Pos, Cos, Sin, WQ, WK, Kc, Vc, Index, Tables, Slots, T, stride_xt, stride_xh, stride_cs,
                       stride_crow, stride_tab, eps, n_q, n_kv, D: tl.constexpr, HALF: tl.constexpr,
                       NORM: tl.constexpr, STORE: tl.constexpr, FROM_TABLE: tl.constexpr, BS: tl.constexpr,
                       TB: tl.constexpr, PDL: tl.constexpr):
    """Program (tile of ``TB`` tokens, head). Under PDL the positions, their cos/sin rows, the
    norm weights and the cache rows are read before ``grid_sync`` (the step's inputs and
    constants, written before its first kernel): after the wait only the projection's output
    is, one round trip, not the position's and then its cos/sin rows' two."""
    t = tl.program_id(0) * TB + tl.arange(0, TB)
    tm = t < T
    h = tl.program_id(1)
    i = tl.arange(0, HALF)
    m = tm[:, None] & (i < HALF)[None, :]
    pos = tl.load(Pos + t, mask=tm, other=0)
    c = tl.load(Cos + pos[:, None] * stride_cs + i[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(Sin + pos[:, None] * stride_cs + i[None, :], mask=m, other=0.0).to(tl.float32)
    is_q = h < n_q
    if NORM:
        w1 = tl.where(is_q, tl.load(WQ + i), tl.load(WK + i)).to(tl.float32)[None, :]
        w2 = tl.where(is_q, tl.load(WQ + HALF + i), tl.load(WK + HALF + i)).to(tl.float32)[None, :]
    if FROM_TABLE:  # each token's cache row: its position's block in its sequence's table row
        slot = tl.load(Slots + t, mask=tm, other=0)
        row = tl.load(Tables + slot * stride_tab + pos // BS, mask=tm, other=0).to(tl.int64) * BS + pos % BS
    else:
        row = tl.load(Index + t, mask=tm, other=0).to(tl.int64)  # (positions again where nothing is stored)
    grid_sync(PDL)
    base = X + t[:, None] * stride_xt + h * stride_xh + i[None, :]
    x1 = tl.load(base, mask=m)
    x2 = tl.load(base + HALF, mask=m)
    if h >= n_q + n_kv:  # a value head: into the cache as it is
        dst = Vc + row[:, None] * stride_crow + (h - n_q - n_kv) * D + i[None, :]
        tl.store(dst, x1, mask=m)
        tl.store(dst + HALF, x2, mask=m)
    else:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        if NORM:
            inv = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / D + eps)[:, None]
            a = (w1 * (a * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
            b = (w2 * (b * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        o1 = (a * c - b * s).to(x1.dtype)
        o2 = (b * c + a * s).to(x1.dtype)
        if STORE and h >= n_q:
            dst = Kc + row[:, None] * stride_crow + (h - n_q) * D + i[None, :]
            tl.store(dst, o1, mask=m)
            tl.store(dst + HALF, o2, mask=m)
        else:
            tl.store(base, o1, mask=m)
            tl.store(base + HALF, o2, mask=m)


# (tokens a program, warps) by the step's tokens: a program per (token, head) of one warp for
# decodes; tiles of tokens for prompts (scripts/bench-kernels --prefill-ops)
ROPE_TILES = {"few": (1, 1), "many": (16, 4)}
ROPE_FEW = 64  # at most this many tokens run a program per token


def rope_store(qkv: torch.Tensor, n_q: int, n_kv: int, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
               k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
               index: torch.Tensor | None = None, tables: torch.Tensor | None = None,
               slots: torch.Tensor | None = None) -> None:
    """qkv [T, n_q + 2 n_kv, hd]: q rotated in place; with caches (contiguous, flat row ``index``
    [T] per token, or where ``index`` is None the row of each token's position in block table
    ``tables`` [rows, max_blocks] row ``slots`` [T]), k rotated and v as is go into them, else k
    is rotated in place and v left."""
    T, heads, D = qkv.shape
    assert qkv.stride(2) == 1 and D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0 and heads == n_q + 2 * n_kv
    store = k_cache is not None
    norm = q_norm is not None
    from_table = store and index is None
    assert not from_table or (tables is not None and slots is not None)
    tb, warps = ROPE_TILES["few" if T <= ROPE_FEW else "many"]
    _rope_store_kernel[(triton.cdiv(T, tb), heads if store else n_q + n_kv)](
        qkv, positions, cos, sin, q_norm if norm else cos, k_norm if norm else cos,
        k_cache if store else qkv, v_cache if store else qkv, positions if index is None else index,
        tables if from_table else positions, slots if from_table else positions, T,
        qkv.stride(0), qkv.stride(1), cos.stride(0), n_kv * D, tables.stride(0) if from_table else 0, eps, n_q, n_kv,
        D=D, HALF=D // 2, NORM=norm, STORE=store, FROM_TABLE=from_table,
        BS=k_cache.shape[1] if store else 1, TB=tb, num_warps=warps, **pdl_args(qkv.device))


# ---------------------------------------------------------------------------------------------
# SiLU(gate) * up over the fused gate/up projection's output.


@triton.jit
def _silu_mul_kernel(X, Out, Q, D, S, stride_x, stride_o, N, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                     PDL: tl.constexpr):
    grid_sync(PDL)
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    gate = tl.load(X + t * stride_x + i, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + t * stride_x + N + i, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    tl.store(Out + t * stride_o + i, out, mask=mask)
    if QUANT:  # as in _rms_norm_kernel
        g = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        quantize_groups(tl.reshape(out.to(tl.float32), (BLOCK // 32, 2, 16)), g, g < N // 32, Q + t * N,
                         D + t * (N // 32), S + t * (N // 16))


# (elements a program, warps): one row in programs of 1024 elements, a few rows in programs of 256
# (more programs in flight): H200, Qwen3-8B q4, a decode step of 8 rows 4.648 -> 4.555 ms; of one
# row 1.872-1.879 against 1.882-1.884 ms in 256s. A prompt's rows: scripts/bench-kernels --prefill-ops.
SILU_TILES = {"one": (1024, 4), "few": (256, 2), "many": (1024, 4)}
SILU_FEW = 64


def silu_mul(gate_up: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """SiLU(gate) * up of [T, 2N]; ``quantize`` (N a multiple of 32): the int8 form too."""
    T, N2 = gate_up.shape
    N = N2 // 2
    out = torch.empty(T, N, device=gate_up.device, dtype=gate_up.dtype)
    block, warps = SILU_TILES["one" if T == 1 else "few" if T <= SILU_FEW else "many"]
    _silu_mul_kernel[(T, triton.cdiv(N, block))](gate_up, out, *_int8_rows(out, quantize), gate_up.stride(0),
                                                   out.stride(0), N, BLOCK=block, QUANT=quantize, num_warps=warps,
                                                   **pdl_args(gate_up.device))
    return out


