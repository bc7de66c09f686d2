"""Paged attention on the GPU (Triton): decode (flash-decoding over the block tables, splits
merged by their log-sum-exp) and prefill (each prompt chunk causally over its cached prefix).
Checked against the torch paths of neuron/runner/attention.py and tests/attention_reference.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import grid_sync, pdl_args, pow2
from .prefill_work import WORK_SPAN, prefill_tiles
from .int8_rows import quantize_groups


# ---------------------------------------------------------------------------------------------
# Paged decode attention (flash-decoding): one program per (sequence, KV head or query head,
# split of the context); a second kernel merges the splits by their log-sum-exp.


@triton.jit
def _store_heads(Out, out, seq, heads, hmask, d, dmask, stride_ot, stride_oh, Q8, Q8D, Q8T, NQ,
                 D: tl.constexpr, GROUP_PAD: tl.constexpr, QUANT: tl.constexpr):
    """A sequence's output rows of ``heads`` [GROUP_PAD, D_PAD]; with ``QUANT`` (D a multiple of
    32) also their int8 groups of 32 in the flat row [NQ * D] (``quantize_groups``), for the
    packed output projection."""
    out = out.to(Out.dtype.element_ty)
    tl.store(Out + seq * stride_ot + heads[:, None] * stride_oh + d[None, :], out, mask=hmask[:, None] & dmask[None, :])
    if QUANT:
        G: tl.constexpr = GROUP_PAD * (D // 32)
        j = tl.arange(0, D // 32)
        g = tl.reshape(heads[:, None] * (D // 32) + j[None, :], (G,))
        ok = tl.reshape(hmask[:, None] & (j[None, :] < D // 32), (G,))
        quantize_groups(tl.reshape(out.to(tl.float32), (G, 2, 16)), g, ok, Q8 + seq * NQ * D,
                         Q8D + seq * (NQ * D // 32), Q8T + seq * (NQ * D // 16))


@triton.jit
def _attend_tile(q, k, v, tmask, m, lsum, acc, scale, PRECISION: tl.constexpr):
    """The online softmax of the queries ``q`` over one tile of keys ``k`` and values ``v``
    (rows where ``tmask``): the running max ``m``, sum ``lsum`` and output ``acc``, updated."""
    s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    lsum = lsum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, lsum, acc


@triton.jit
def _decode_kernel(Q, K, V, Tables, Slots, Ctx, Pos, KvOfQ, Out, PartOut, PartLse, Counters, Q8, Q8D, Q8T,
                   stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_tab,
                   stride_ot, stride_oh, scale, NQ,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, UNIFORM: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
                   NSPLIT: tl.constexpr, NSPLIT_PAD: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
                   MERGE: tl.constexpr, CTX_FROM_POS: tl.constexpr, PDL: tl.constexpr):
    """Under PDL the program reads the step's inputs (context lengths, slots, block tables)
    before ``grid_sync``, and where its split is one tile of keys (short contexts), that tile's
    cached keys and values too: all were written before the step's first kernel, but for the
    sequence's newest key and value, which the kernel before this one (``rope_store``) writes
    and which are read after the wait. So the chain of loads after the wait is one round trip (q
    and the newest key), not four (context, table, keys, values). A longer split runs its tiles
    in the loop, whose loads Triton pipelines from the first tile: fetching that tile ahead of
    the loop cost 8 streams of 4000 tokens 1.8% of a bf16 step on an H200."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    if CTX_FROM_POS:  # a decode's context ends at its position
        ctx = (tl.load(Pos + seq) + 1).to(tl.int32)
    else:
        ctx = tl.load(Ctx + seq)
    slot = tl.load(Slots + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    dmask = d < D
    if UNIFORM:
        heads = head * GROUP + g
        kv_head = head
        hmask = g < GROUP
    else:
        heads = head + g * 0
        kv_head = tl.load(KvOfQ + head)
        hmask = g < 1
    # The context is split evenly by its own length (whole tiles), not by the longest context
    # the launch serves: the splits past it are empty and cost almost nothing.
    split_tokens = ((ctx + NSPLIT - 1) // NSPLIT + TILE - 1) // TILE * TILE
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, ctx)
    one = end - start <= TILE  # (an empty split too)
    t = start + tl.arange(0, TILE)
    tmask = t < tl.where(one, end, start)  # nothing where the split is longer
    block = tl.load(Tables + slot * stride_tab + t // BS, mask=tmask, other=0)
    offs = block.to(tl.int64) * stride_kb + (t % BS) * stride_kt + kv_head * stride_kh
    cached = (tmask & (t < ctx - 1))[:, None] & dmask[None, :]
    k = tl.load(K + offs[:, None] + d[None, :], mask=cached, other=0.0)
    v = tl.load(V + offs[:, None] + d[None, :], mask=cached, other=0.0)
    grid_sync(PDL)
    q = tl.load(Q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    if one:
        if start < end:
            newest = (tmask & (t == ctx - 1))[:, None] & dmask[None, :]
            k = tl.where(newest, tl.load(K + offs[:, None] + d[None, :], mask=newest, other=0.0), k)
            v = tl.where(newest, tl.load(V + offs[:, None] + d[None, :], mask=newest, other=0.0), v)
            m, lsum, acc = _attend_tile(q, k, v, tmask, m, lsum, acc, scale, PRECISION)
    else:
        for t0 in range(start, end, TILE):
            t = t0 + tl.arange(0, TILE)
            tmask = t < end
            block = tl.load(Tables + slot * stride_tab + t // BS, mask=tmask, other=0)
            offs = block.to(tl.int64) * stride_kb + (t % BS) * stride_kt + kv_head * stride_kh
            kvmask = tmask[:, None] & dmask[None, :]
            k = tl.load(K + offs[:, None] + d[None, :], mask=kvmask, other=0.0)
            v = tl.load(V + offs[:, None] + d[None, :], mask=kvmask, other=0.0)
            m, lsum, acc = _attend_tile(q, k, v, tmask, m, lsum, acc, scale, PRECISION)
    empty = lsum == 0.0
    out = acc / tl.where(empty, 1.0, lsum)[:, None]
    if NSPLIT == 1:
        _store_heads(Out, out, seq, heads, hmask, d, dmask, stride_ot, stride_oh, Q8, Q8D, Q8T, NQ, D, GROUP_PAD,
                     QUANT)
    else:
        # Each split leaves its partial result; the last split of the (sequence, heads) to finish
        # merges them by their log-sum-exp (one launch, no merge kernel).
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, lsum)))
        row = (seq * tl.num_programs(1) * GROUP + heads) * NSPLIT + split
        tl.store(PartOut + row[:, None] * D_PAD + d[None, :], out, mask=hmask[:, None])
        tl.store(PartLse + row, lse, mask=hmask)
        counter = Counters + seq * tl.num_programs(1) + head
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == NSPLIT - 1:
            s_ = tl.arange(0, NSPLIT_PAD)
            smask = s_ < NSPLIT
            rows = (seq * tl.num_programs(1) * GROUP + heads)[:, None] * NSPLIT + s_[None, :]  # [G, S]
            lses = tl.load(PartLse + rows, mask=hmask[:, None] & smask[None, :], other=float("-inf"),
                           cache_modifier=".cg")
            top = tl.max(lses, 1)
            w = tl.where(lses > float("-inf"), tl.exp(lses - tl.where(top > float("-inf"), top, 0.0)[:, None]), 0.0)
            w = w / tl.maximum(tl.sum(w, 1), 1e-30)[:, None]
            merged = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
            # Only the splits that hold keys: reading every split's part one after another cost a
            # 300-token decode 20 us per layer at 33 splits. MERGE parts a round, their loads in
            # flight together (one L2 round trip where there were MERGE).
            used = (ctx + split_tokens - 1) // split_tokens
            for i0 in range(0, used, MERGE):
                for j in tl.static_range(MERGE):
                    i = i0 + j
                    part = tl.load(PartOut + ((seq * tl.num_programs(1) * GROUP + heads) * NSPLIT + i)[:, None]
                                   * D_PAD + d[None, :], mask=(hmask & (g * 0 + i < used))[:, None], other=0.0,
                                   cache_modifier=".cg")
                    wi = tl.sum(tl.where(s_[None, :] == i, w, 0.0), 1)
                    merged += part * wi[:, None]
            _store_heads(Out, merged, seq, heads, hmask, d, dmask, stride_ot, stride_oh, Q8, Q8D, Q8T, NQ, D,
                         GROUP_PAD, QUANT)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


# Split parts the last split of a decode merges a round (loaded together).
MERGE_PARTS = 4


def quantizable(head_dim: int) -> bool:
    """Whether ``paged_decode`` can write its output's int8 form: whole groups of 32 per head."""
    return head_dim % 32 == 0 and head_dim == pow2(head_dim)


def decode_splits(batch: int, programs_per_split: int, max_ctx: int, sm_count: int, tile: int = 64) -> int:
    """Context splits per sequence: as many as fill the GPU's multiprocessors once, no split
    shorter than one tile. (Twice as many, a second wave, made a one-sequence decode of 8 KV
    heads slower at every context tried on an H200: 6.5 against 5.8 us a layer at 128 tokens,
    25.4 against 17.3 at 4000.)"""
    want = sm_count // max(1, batch * programs_per_split)
    return max(1, min(want, -(-max_ctx // tile), 64))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 slots: torch.Tensor, ctx: torch.Tensor | None, kv_of_q: torch.Tensor, gqa_repeat: int,
                 scale: float, splits: int, counters: torch.Tensor, out: torch.Tensor | None = None,
                 int8_rows: tuple[torch.Tensor, ...] | None = None,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence. q [B, n_q, hd] (rows may be strided); caches
    [blocks, block_size, n_kv, hd]; tables [rows, max_blocks] int32 indexed by ``slots`` [B];
    ``ctx`` [B] keys per sequence (the new token's included), or None and ``positions`` [B] (the
    new token's: the context is one more). Returns [B, n_q, hd].
    ``splits`` fixes the launch grid (so a CUDA graph captured with it serves any context); each
    sequence's context is split evenly into as many parts, of whole tiles. ``counters`` is an
    int32 scratch of at least B * n_q zeros, left zero. ``int8_rows``: buffers
    (``int8_rows_buffers(B, n_q * hd)``, ``quantizable(hd)``) the output's int8 form goes into too."""
    B, n_q, D = q.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and counters.numel() >= B * n_q
    assert int8_rows is None or quantizable(D)
    assert ctx is not None or positions is not None
    out = torch.empty(B, n_q, D, device=q.device, dtype=q.dtype) if out is None else out
    uniform = gqa_repeat > 0
    group = gqa_repeat if uniform else 1
    heads = n_q // group
    d_pad = pow2(D)
    part_out = part_lse = out
    if splits > 1:
        part_out = torch.empty(B * n_q * splits, d_pad, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(B * n_q * splits, device=q.device, dtype=torch.float32)
    _decode_kernel[(B, heads, splits)](
        q, k_cache, v_cache, tables, slots, positions if ctx is None else ctx, positions if ctx is None else ctx,
        kv_of_q, out, part_out, part_lse, counters,
        *(int8_rows or (out, out, out)),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1), scale, n_q,
        GROUP=group, GROUP_PAD=max(16, pow2(group)), UNIFORM=uniform, D=D, D_PAD=d_pad,
        BS=k_cache.shape[1], TILE=64, NSPLIT=splits, NSPLIT_PAD=pow2(splits),
        # float32 models get float32 products (tl.dot would otherwise round its inputs to tf32)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANT=int8_rows is not None,
        MERGE=min(MERGE_PARTS, pow2(splits)), CTX_FROM_POS=ctx is None, num_warps=4, **pdl_args(q.device))
    return out


# ---------------------------------------------------------------------------------------------
# Paged prefill attention (flash attention forward): the prompt chunks of a step in one launch,
# each over its sequence's keys read through the block table. One program per (query tile of a
# chunk, KV head with its query heads, chunk); the rows of a tile are (query, head of the group)
# pairs, so a KV tile is read once for the whole group.


@triton.jit
def _prefill_keys(q, m, lsum, acc, K, V, Tables, slot, kv_head, qpos, lo, hi, d, dmask,
                  stride_kb, stride_kt, stride_kh, stride_tab, qk_scale,
                  BS: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Folds keys lo..hi-1 into the running (max, sum, output) of the tile's rows. Without
    CAUSAL every row may see every key of the range (and the range is whole tiles)."""
    for k0 in range(lo, hi, BLOCK_N):
        t = k0 + tl.arange(0, BLOCK_N)
        if CAUSAL:
            tmask = t < hi
            block = tl.load(Tables + slot * stride_tab + t // BS, mask=tmask, other=0)
            kvmask = tmask[:, None] & dmask[None, :]
        else:
            block = tl.load(Tables + slot * stride_tab + t // BS)
            kvmask = dmask[None, :]
        offs = block.to(tl.int64) * stride_kb + (t % BS) * stride_kt + kv_head * stride_kh
        k = tl.load(K + offs[:, None] + d[None, :], mask=kvmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if CAUSAL:
            s = tl.where(t[None, :] <= qpos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        v = tl.load(V + offs[:, None] + d[None, :], mask=kvmask, other=0.0)
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return m, lsum, acc


@triton.jit(do_not_specialize=["T"])  # one compiled kernel for every step length
def _prefill_kernel(Q, K, V, Tables, Spans, KvOfQ, Out, Work,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_tab,
                    stride_ot, stride_oh, qk_scale,
                    GROUP: tl.constexpr, UNIFORM: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
                    PartOut, PartML, T, NQ, PDL: tl.constexpr, WORK: tl.constexpr, SPAN: tl.constexpr,
                    MIN_TILES: tl.constexpr):
    """A tile is ``ROWS`` consecutive (query, head of the group) pairs of a chunk, whatever the
    group's size: a group of 6 wastes no rows, as padding it to 8 would. ``WORK``: each program's
    (span, tile) is its item of ``Work`` (``prefill_work.py``), not its place in the grid."""
    grid_sync(PDL)  # before the early exit below: a program may finish only after it
    head = tl.program_id(1)
    if WORK:
        item = tl.load(Work + tl.program_id(0))
        span = tl.where(item >= 0, item // SPAN, 0)
        tile = tl.where(item >= 0, item % SPAN, SPAN)  # padding: a tile past every chunk
        split = tl.program_id(2)
    else:
        tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the last tiles see the most keys: start them first
        span = tl.program_id(2) // SPLITS
        split = tl.program_id(2) % SPLITS
    row0 = tl.load(Spans + span * 4)
    n = tl.load(Spans + span * 4 + 1)
    slot = tl.load(Spans + span * 4 + 2)
    start = tl.load(Spans + span * 4 + 3)
    m0 = tile * ROWS // GROUP  # the tile's first query
    if m0 < n:  # the grid covers the longest chunk
        r = tile * ROWS + tl.arange(0, ROWS)
        i = r // GROUP  # the row's query within the chunk
        hmask = i < n
        if UNIFORM:
            heads = head * GROUP + r % GROUP
            kv_head = head
        else:
            heads = head + r * 0
            kv_head = tl.load(KvOfQ + head)
        d = tl.arange(0, D_PAD)
        dmask = d < D
        qmask = hmask[:, None] & dmask[None, :]
        q = tl.load(Q + (row0 + i)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=qmask, other=0.0)
        q = q.to(K.dtype.element_ty)
        qpos = start + i  # query i of the chunk sees keys 0 ..= start + i
        m = tl.full([ROWS], float("-inf"), tl.float32)
        lsum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D_PAD], tl.float32)
        # Keys every row of the tile sees need no mask; the rest, up to the tile's last query,
        # are masked per row. Keys past the last query are never read.
        full = (start + m0 + 1) // BLOCK_N * BLOCK_N
        end = start + tl.minimum((tile * ROWS + ROWS - 1) // GROUP + 1, n)
        # One of SPLITS ranges of whole key tiles, MIN_TILES at least (the last may be empty).
        share = tl.maximum(tl.cdiv(tl.cdiv(end, BLOCK_N), SPLITS), MIN_TILES) * BLOCK_N
        lo = split * share
        hi = tl.minimum(end, lo + share)
        m, lsum, acc = _prefill_keys(q, m, lsum, acc, K, V, Tables, slot, kv_head, qpos, lo, tl.minimum(hi, full),
                                     d, dmask, stride_kb, stride_kt, stride_kh, stride_tab, qk_scale,
                                     BS, BLOCK_N, False, PRECISION)
        m, lsum, acc = _prefill_keys(q, m, lsum, acc, K, V, Tables, slot, kv_head, qpos, tl.maximum(lo, full), hi,
                                     d, dmask, stride_kb, stride_kt, stride_kh, stride_tab, qk_scale,
                                     BS, BLOCK_N, True, PRECISION)
        rows_at = (row0 + i)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        if SPLITS == 1:
            out = acc / lsum[:, None]  # every row sees key 0 at least
            tl.store(Out + rows_at + d[None, :], out.to(Out.dtype.element_ty), mask=qmask)
        elif lo < end:  # the range's unnormalised output, running max and sum; _prefill_merge adds them up
            part = (split * T + row0 + i).to(tl.int64) * NQ + heads  # [SPLITS, T, n_q] rows
            tl.store(PartOut + part[:, None] * D_PAD + d[None, :], acc, mask=qmask)
            tl.store(PartML + part * 2, m, mask=hmask)
            tl.store(PartML + part * 2 + 1, lsum, mask=hmask)


@triton.jit(do_not_specialize=["T"])
def _prefill_merge(PartOut, PartML, Out, T, NQ, stride_ot, stride_oh, D: tl.constexpr, D_PAD: tl.constexpr,
                   SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One (row, head): the SPLITS key ranges' outputs weighted by their share of the softmax. A
    row no chunk covers (a graph's padding) has only empty ranges and gets zeros."""
    grid_sync(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    parts = (tl.arange(0, SPLITS) * T + row).to(tl.int64) * NQ + head
    ms = tl.load(PartML + parts * 2)
    ls = tl.load(PartML + parts * 2 + 1)
    w = tl.where(ms == float("-inf"), 0.0, tl.exp2(ms - tl.max(ms, 0)))  # an empty range weighs nothing
    acc = tl.load(PartOut + parts[:, None] * D_PAD + d[None, :], mask=(w > 0)[:, None], other=0.0)
    # A range that a row sees no key of (past its position, or never written) is not read: its
    # sums are NaN or garbage.
    total = tl.sum(tl.where(w[:, None] > 0, acc * w[:, None], 0.0), 0)
    lsum = tl.sum(tl.where(w > 0, ls * w, 0.0), 0)
    out = tl.where(lsum > 0, total / tl.where(lsum > 0, lsum, 1.0), 0.0)
    tl.store(Out + row.to(tl.int64) * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  spans: torch.Tensor, kv_of_q: torch.Tensor, gqa_repeat: int, scale: float, max_n: int,
                  out: torch.Tensor | None = None, splits: int = 1, work: torch.Tensor | None = None,
                  min_split_keys: int = 512) -> torch.Tensor:
    """Causal attention of prompt chunks over the paged cache. q [T, n_q, hd] (rows may be
    strided); caches [blocks, block_size, n_kv, hd]; tables [rows, max_blocks] int32; ``spans``
    [S, 4] int32, one (first row in q, tokens n, table row, start position) per chunk: query i of
    a chunk is at position start + i and sees keys 0 ..= start + i. ``max_n`` bounds every n.
    Writes the chunks' rows of ``out`` [T, n_q, hd] (allocated when None; other rows untouched).
    ``splits`` > 1 (a power of two) divides each tile's keys into that many ranges run by their own programs and
    merged after (a short chunk after a long cached prefix would otherwise keep a few programs
    busy over thousands of keys); the merge writes every row of ``out``, so each row must then
    be a chunk's or padding (a prefill graph's rows are). A range holds ``min_split_keys`` keys at
    least: a short context leaves the last ranges empty. ``work``: the chunks' tiles as
    ``prefill_work.prefill_work`` lists them (int64), one program each (a prefill graph's)."""
    T, n_q, D = q.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and spans.dtype == torch.int32 and spans.is_contiguous()
    assert splits == pow2(splits)
    out = torch.empty(T, n_q, D, device=q.device, dtype=q.dtype) if out is None else out
    uniform = gqa_repeat > 0
    group = gqa_repeat if uniform else 1
    d_pad = pow2(D)
    rows, block_n, warps, stages = prefill_tiles(d_pad, q.device)
    if work is not None:
        grid = (work.numel(), n_q // group, splits)
    else:
        grid = (triton.cdiv(max(1, max_n) * group, rows), n_q // group, spans.shape[0] * splits)
    part_out = part_ml = q  # unused without splits
    if splits > 1:
        part_out = torch.empty(splits, T, n_q, d_pad, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(splits, T, n_q, 2, device=q.device, dtype=torch.float32)
        part_ml[..., 0] = float("-inf")  # (max, sum) of a range no program writes: empty
        part_ml[..., 1] = 0.0
    _prefill_kernel[grid](
        q, k_cache, v_cache, tables, spans, kv_of_q, out, spans if work is None else work,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1), scale * 1.4426950408889634,  # exp2 of log2(e) * x is exp(x)
        GROUP=group, UNIFORM=uniform, D=D, D_PAD=d_pad, BS=k_cache.shape[1], ROWS=rows, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLITS=splits,
        PartOut=part_out, PartML=part_ml, T=T, NQ=n_q, WORK=work is not None, SPAN=WORK_SPAN,
        MIN_TILES=max(1, -(-min_split_keys // block_n)), num_warps=warps, num_stages=stages,
        **pdl_args(q.device))
    if splits > 1:
        _prefill_merge[(T, n_q)](part_out, part_ml, out, T, n_q, out.stride(0), out.stride(1), D=D, D_PAD=d_pad,
                                 SPLITS=splits, **pdl_args(q.device))
    return out


