"""The Gated DeltaNet kernels (Triton): the gated delta rule with its recurrent state, and the
gated RMS norm of its output (the causal conv before it: ``conv``). Checked against the torch
reference in neuron/models/recurrence.py.

Every kernel takes the step's sequences as spans: a [3, S] int64 table whose rows are each
sequence's first token row, its tokens and its state slot. A decode graph and a prefill graph
pass theirs from their static inputs; a span of 0 tokens does nothing.

The delta rule runs in one of two ways:

- ``delta_rule_recurrent``: token after token, one program per (sequence, value head, block of
  the value dimension) holding its share of the state in registers. Decodes take this.
- ``delta_rule_chunked``: the chunked (WY) form, for prompt chunks. The host cuts each sequence
  into chunks of at most 64 tokens, ending one wherever a snapshot of the state is asked for (the
  prefix cache: ``conv.conv_snapshots`` takes the conv state's). A first kernel prepares each chunk
  independently (one program per chunk and value head): the
  inverse of the chunk's unit lower-triangular system ``I + A`` as the product
  ``(I - A)(I + A^2)(I + A^4)...`` (A is nilpotent: six factors for 64 rows, all matrix products),
  and from it the chunk's ``w`` and ``u``, its decayed queries and keys and its intra-chunk scores,
  into scratch rows beside the tokens'. A second kernel walks each sequence's chunks in order,
  carrying the state from one to the next and storing it into the snapshot slots on the way (one
  program per sequence, value head and block of the value dimension).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETED, dot_precision, grid_sync, pdl_args, pow2

CHUNK = 64


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


# ---------------------------------------------------------------------------------------------
# The gates and the normalized q/k of a token row


@triton.jit
def _gates(A, B, NegA, DtBias, r, stride_ab, h, valid):
    """g (the log decay) and beta of value head ``h`` at token rows ``r``."""
    a = tl.load(A + r * stride_ab + h, mask=valid, other=0.0).to(tl.float32)
    b = tl.load(B + r * stride_ab + h, mask=valid, other=0.0).to(tl.float32)
    g = tl.load(NegA + h) * _softplus(a + tl.load(DtBias + h))
    return tl.where(valid, g, 0.0), tl.where(valid, tl.sigmoid(b), 0.0)


@triton.jit
def _l2norm(x, axis: tl.constexpr):
    return x * tl.rsqrt(tl.sum(x * x, axis, keep_dims=True) + 1e-6)


# ---------------------------------------------------------------------------------------------
# The delta rule, token after token


@triton.jit(do_not_specialize=["span_stride"])  # one compile for every count of spans
def _recurrent_kernel(QKV, A, B, NegA, DtBias, State, Out, Spans, span_stride, stride_qkv, stride_ab, stride_o,
                      stride_slot, key_dim, scale, R: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, UNCHUNKED: tl.constexpr, PDL: tl.constexpr):
    """``UNCHUNKED``: the spans' table has the chunked form's rows too; only the spans it gives no
    chunks are this kernel's."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // R
    ik = tl.arange(0, BK)
    km = ik < HK
    iv = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = iv < HV
    grid_sync(PDL)
    row = tl.load(Spans + s)
    n = tl.load(Spans + span_stride + s)
    slot = tl.load(Spans + 2 * span_stride + s)
    if UNCHUNKED:
        n = tl.where(tl.load(Spans + 4 * span_stride + s) > 0, 0, n)
    if n > 0:  # (a graph's padding spans all name one scratch slot: not read at all)
        at = State + slot * stride_slot + h * HK * HV + ik[:, None] * HV + iv[None, :]
        both = km[:, None] & vm[None, :]
        S = tl.load(at, mask=both, other=0.0).to(tl.float32)
        for t in range(0, n):
            r = row + t
            base = QKV + r * stride_qkv
            q = tl.load(base + kh * HK + ik, mask=km, other=0.0).to(tl.float32)
            k = tl.load(base + key_dim + kh * HK + ik, mask=km, other=0.0).to(tl.float32)
            v = tl.load(base + 2 * key_dim + h * HV + iv, mask=vm, other=0.0).to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
            g, beta = _gates(A, B, NegA, DtBias, r, stride_ab, h, r >= 0)
            S = S * tl.exp(g)
            u = (v - tl.sum(S * k[:, None], 0)) * beta
            S = S + k[:, None] * u[None, :]
            tl.store(Out + r * stride_o + h * HV + iv, tl.sum(S * q[:, None], 0), mask=vm)
        tl.store(at, S.to(State.dtype.element_ty), mask=both)


def _value_block(hv: int, programs: int, device: torch.device) -> int:
    """The value-dimension block of a delta-rule program: smaller blocks when the spans and heads
    alone leave the GPU's multiprocessors idle."""
    from .launch import multiprocessors

    bv = min(pow2(hv), 64)
    while bv > 16 and programs * triton.cdiv(hv, bv) < 2 * multiprocessors(device):
        bv //= 2
    return bv


def delta_rule_recurrent(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor,
                         dt_bias: torch.Tensor, state: torch.Tensor, spans: torch.Tensor, r: int,
                         out: torch.Tensor | None = None, unchunked: bool = False) -> torch.Tensor:
    """The gated delta rule over each span's rows, token after token, from and back into its
    ``state`` [slots, nv, hk, hv] slot. ``qkv`` [T, 2 nk hk + nv hv] (q, k, v after the conv),
    ``a``, ``b`` [T, nv] (rows of any stride); float32 out [T, nv * hv]. ``unchunked``: ``spans``
    is the chunked form's table; only the spans it gives no chunks are run (``delta_rule``)."""
    T = qkv.shape[0]
    _, nv, hk, hv = state.shape
    S = spans.shape[1]
    out = torch.empty(T, nv * hv, dtype=torch.float32, device=qkv.device) if out is None else out
    if not S or not T:
        return out
    bv = _value_block(hv, S * nv, qkv.device)
    assert a.stride(0) == b.stride(0)
    _recurrent_kernel[(S, nv, triton.cdiv(hv, bv))](
        qkv, a, b, neg_a, dt_bias, state, out, spans, spans.stride(0), qkv.stride(0), a.stride(0), out.stride(0),
        state.stride(0), (nv // r) * hk, hk ** -0.5, R=r, HK=hk, HV=hv, BK=pow2(hk), BV=bv, UNCHUNKED=unchunked,
        num_warps=4, **pdl_args(qkv.device))
    return out


def delta_rule(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor, spans: torch.Tensor, chunks: torch.Tensor | None, r: int) -> torch.Tensor:
    """The delta rule of a step: token after token where there is no ``chunks`` table, else in
    chunks for the sequences it cuts, and token after token for the single-token ones it leaves
    out (a step's decodes beside prompt chunks)."""
    if chunks is None:
        return delta_rule_recurrent(qkv, a, b, neg_a, dt_bias, state, spans, r)
    out = delta_rule_recurrent(qkv, a, b, neg_a, dt_bias, state, spans, r, unchunked=True)
    return delta_rule_chunked(qkv, a, b, neg_a, dt_bias, state, spans, chunks, r, out)


# ---------------------------------------------------------------------------------------------
# The delta rule in chunks


@triton.jit(do_not_specialize=["chunk_stride"])
def _chunk_prep_kernel(QKV, A, B, NegA, DtBias, Chunks, chunk_stride, stride_qkv, stride_ab, key_dim, scale,
                       Wo, Uo, QKo, Io, Co, Go, NV: tl.constexpr, R: tl.constexpr, HK: tl.constexpr,
                       HV: tl.constexpr, BK: tl.constexpr, BVA: tl.constexpr, BT: tl.constexpr,
                       STEPS: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    """One chunk (of one sequence) and one value head: its w [BT, hk], u [BT, hv] and intra-chunk
    scores [BT, BT] into the scratch rows of its tokens, with the cumulative log decay of each
    token; its total log decay into the chunk's scratch; the normalized queries and keys of its
    key head (by the key head's first value head)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // R
    grid_sync(PDL)
    row = tl.load(Chunks + c)
    n = tl.load(Chunks + chunk_stride + c)
    if n > 0:
        i = tl.arange(0, BT)
        tm = i < n
        r = row + i
        ik = tl.arange(0, BK)
        km = ik < HK
        iv = tl.arange(0, BVA)
        vm = iv < HV
        base = QKV + r[:, None] * stride_qkv
        mk = tm[:, None] & km[None, :]
        q = tl.load(base + kh * HK + ik[None, :], mask=mk, other=0.0).to(tl.float32)
        k = tl.load(base + key_dim + kh * HK + ik[None, :], mask=mk, other=0.0).to(tl.float32)
        q = _l2norm(q, 1) * scale
        k = _l2norm(k, 1)
        g, beta = _gates(A, B, NegA, DtBias, r, stride_ab, h, tm)
        cum = tl.cumsum(g, 0)
        causal = i[:, None] >= i[None, :]
        decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PREC) * decay
        hrow = (r * NV + h)[:, None]
        tl.store(Io + hrow * BT + i[None, :], scores, mask=tm[:, None])
        if h % R == 0:
            krow = ((r * (NV // R) + kh) * 2)[:, None] * HK + ik[None, :]
            tl.store(QKo + krow, q, mask=mk)
            tl.store(QKo + krow + HK, k, mask=mk)
        kb = k * beta[:, None]
        a_ = tl.where(i[:, None] > i[None, :], tl.dot(kb, tl.trans(k), input_precision=PREC) * decay, 0.0)
        inv = tl.where(i[:, None] == i[None, :], 1.0, 0.0) - a_
        p = a_
        for _ in tl.static_range(STEPS):
            p = tl.dot(p, p, input_precision=PREC)
            inv = inv + tl.dot(inv, p, input_precision=PREC)
        w = tl.dot(inv, kb * tl.exp(cum)[:, None], input_precision=PREC)
        tl.store(Wo + hrow * HK + ik[None, :], w, mask=mk)
        v = tl.load(base + 2 * key_dim + h * HV + iv[None, :], mask=tm[:, None] & vm[None, :],
                    other=0.0).to(tl.float32)
        u = tl.dot(inv, v * beta[:, None], input_precision=PREC)
        tl.store(Uo + hrow * HV + iv[None, :], u, mask=tm[:, None] & vm[None, :])
        tl.store(Co + r * NV + h, cum, mask=tm)
        tl.store(Go + c * NV + h, tl.sum(g, 0))


@triton.jit(do_not_specialize=["span_stride", "chunk_stride"])
def _chunk_scan_kernel(Wi, Ui, QKi, Ii, Ci, Gi, State, Out, Spans, span_stride, Chunks, chunk_stride, stride_o,
                       stride_slot, NV: tl.constexpr, R: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                       LOW: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):
    """One sequence, value head and block of the value dimension: its chunks in order, the state
    carried from each to the next in registers (and copied into a snapshot slot after a chunk that
    ends at a snapshot), then back into its slot. ``LOW``: the products take the state and the
    chunk's new values in the scratch's 16-bit type (the state itself stays float32)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // R
    iv = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = iv < HV
    ik = tl.arange(0, BK)
    km = ik < HK
    i = tl.arange(0, BT)
    grid_sync(PDL)
    slot = tl.load(Spans + 2 * span_stride + s)
    first = tl.load(Spans + 3 * span_stride + s)
    count = tl.load(Spans + 4 * span_stride + s)
    head = h * HK * HV + ik[:, None] * HV + iv[None, :]
    at = State + slot * stride_slot + head
    both = km[:, None] & vm[None, :]
    if count > 0:  # (a span without chunks is the recurrent kernel's; padding is not read at all)
        S = tl.load(at, mask=both, other=0.0).to(tl.float32)
        for c in range(first, first + count):
            row = tl.load(Chunks + c)
            tm = i < tl.load(Chunks + chunk_stride + c)
            snap = tl.load(Chunks + 2 * chunk_stride + c)
            r = row + i
            hrow = (r * NV + h)[:, None]
            krow = ((r * (NV // R) + kh) * 2)[:, None] * HK + ik[None, :]
            mk = tm[:, None] & km[None, :]
            mv = tm[:, None] & vm[None, :]
            cum = tl.load(Ci + r * NV + h, mask=tm, other=0.0)
            total = tl.load(Gi + c * NV + h)
            w = tl.load(Wi + hrow * HK + ik[None, :], mask=mk, other=0.0).to(tl.float32)
            q = tl.load(QKi + krow, mask=mk, other=0.0).to(tl.float32) * tl.exp(cum)[:, None]
            k = tl.load(QKi + krow + HK, mask=mk, other=0.0).to(tl.float32) * tl.exp(total - cum)[:, None]
            scores = tl.load(Ii + hrow * BT + i[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
            u = tl.load(Ui + hrow * HV + iv[None, :], mask=mv, other=0.0).to(tl.float32)
            Sd = S
            if LOW:
                low = Wi.dtype.element_ty
                w, q, k, scores, Sd = w.to(low), q.to(low), k.to(low), scores.to(low), S.to(low)
                if INTERPRETED:  # (whose 16-bit products are wrong): the same roundings, products in float32
                    w, q, k, scores, Sd = w.to(tl.float32), q.to(tl.float32), k.to(tl.float32), \
                        scores.to(tl.float32), Sd.to(tl.float32)
            new = u - tl.dot(w, Sd, input_precision=PREC)
            nd = new.to(Wi.dtype.element_ty).to(scores.dtype) if LOW else new
            o = tl.dot(q, Sd, input_precision=PREC) + tl.dot(scores, nd, input_precision=PREC)
            tl.store(Out + r[:, None] * stride_o + h * HV + iv[None, :], o, mask=mv)
            S = S * tl.exp(total) + tl.dot(tl.trans(k), nd, input_precision=PREC)
            if snap >= 0:
                tl.store(State + snap * stride_slot + head, S.to(State.dtype.element_ty), mask=both)
        tl.store(at, S.to(State.dtype.element_ty), mask=both)


# launch settings, from scripts/bench-kernels (bv 0: by the grid's size; low: 16-bit products in
# the scan for a 16-bit model, as the peers' kernels take them)
SCAN = {"warps": 4, "stages": 2, "bv": 0, "low": True}
PREP = {"warps": 4, "stages": 1}


def delta_rule_chunked(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor,
                       dt_bias: torch.Tensor, state: torch.Tensor, spans: torch.Tensor, chunks: torch.Tensor,
                       r: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``delta_rule_recurrent``'s result, in chunks: ``chunks`` [3, C] int64 (first row, tokens
    (at most ``CHUNK``; 0: none), and the slot that takes the state after it, or -1), each span's
    in order from ``spans``' rows 3 and 4 (its first chunk and their count). The scratch between
    the two kernels is float32 for a float32 model, else 16-bit: the model's dtype is that of ``a``
    (a projection's output; ``qkv`` comes from the conv in float32 whatever the model's)."""
    T = qkv.shape[0]
    _, nv, hk, hv = state.shape
    S, C = spans.shape[1], chunks.shape[1]
    out = torch.empty(T, nv * hv, dtype=torch.float32, device=qkv.device) if out is None else out
    if not S or not T or not C:
        return out
    assert (S == 1 or spans.stride(1) == 1) and (C == 1 or chunks.stride(1) == 1) and a.stride(0) == b.stride(0)
    wide = a.dtype == torch.float32
    scratch = dict(dtype=torch.float32 if wide else torch.bfloat16, device=qkv.device)
    f32 = dict(dtype=torch.float32, device=qkv.device)
    w, u = torch.empty(T, nv, hk, **scratch), torch.empty(T, nv, hv, **scratch)
    qk = torch.empty(T, nv // r, 2, hk, **scratch)
    scores = torch.empty(T, nv, CHUNK, **scratch)
    cum, total = torch.empty(T, nv, **f32), torch.empty(C, nv, **f32)
    BK, BVA = max(pow2(hk), 16), max(pow2(hv), 16)
    prec = dot_precision(a.dtype)
    _chunk_prep_kernel[(C, nv)](
        qkv, a, b, neg_a, dt_bias, chunks, chunks.stride(0), qkv.stride(0), a.stride(0), (nv // r) * hk, hk ** -0.5,
        w, u, qk, scores, cum, total, NV=nv, R=r, HK=hk, HV=hv, BK=BK, BVA=BVA, BT=CHUNK,
        STEPS=CHUNK.bit_length() - 2, PREC=prec, num_warps=PREP["warps"], num_stages=PREP["stages"],
        **pdl_args(qkv.device))
    # by one prompt's programs, not the table's spans: a graph's table has one a slot, nearly all empty
    bv = SCAN["bv"] or max(_value_block(hv, nv, qkv.device), min(32, BVA))
    low = SCAN["low"] and not wide
    _chunk_scan_kernel[(S, nv, triton.cdiv(hv, bv))](
        w, u, qk, scores, cum, total, state, out, spans, spans.stride(0), chunks, chunks.stride(0), out.stride(0),
        state.stride(0), NV=nv, R=r, HK=hk, HV=hv, BK=BK, BV=bv, BT=CHUNK, PREC="ieee" if low and not INTERPRETED
        else prec, LOW=low, INTERPRETED=INTERPRETED, num_warps=SCAN["warps"], num_stages=SCAN["stages"], **pdl_args(qkv.device))
    return out


# ---------------------------------------------------------------------------------------------
# The gated RMS norm


@triton.jit
def _gated_norm_kernel(O, Z, W, Out, stride_o, stride_z, stride_out, eps, NV: tl.constexpr, HV: tl.constexpr,
                       BV: tl.constexpr, HB: tl.constexpr, PDL: tl.constexpr):
    """A token's ``HB`` heads a program: each head's rows normed apart."""
    t = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    i = tl.arange(0, BV)
    m = (h < NV)[:, None] & (i < HV)[None, :]
    w = tl.load(W + i, mask=i < HV, other=0.0)
    grid_sync(PDL)
    dtype = Out.dtype.element_ty
    at = h[:, None] * HV + i[None, :]
    o = tl.load(O + t * stride_o + at, mask=m, other=0.0).to(dtype).to(tl.float32)
    z = tl.load(Z + t * stride_z + at, mask=m, other=0.0).to(tl.float32)
    o = o * tl.rsqrt(tl.sum(o * o, 1) / HV + eps)[:, None]
    y = (w.to(tl.float32)[None, :] * o.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    gate = (z * tl.sigmoid(z)).to(dtype).to(tl.float32)
    tl.store(Out + t * stride_out + at, (y * gate).to(dtype), mask=m)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(o per head of ``weight``'s size) * silu(z), in z's dtype; o [T, nv * hv] float32,
    z [T, nv * hv] (rows of any stride). A program takes up to 1,024 of a token's values, whole
    heads: one program per head and token left the GPU scheduling tiny blocks (a 2,048-token
    Qwen3.5-27B chunk took 250 us, several times its bytes' time: profile-step --profile)."""
    T, width = z.shape
    hv = weight.shape[0]
    nv = width // hv
    out = torch.empty(T, width, dtype=z.dtype, device=z.device)
    if T:
        bv = pow2(hv)
        hb = min(pow2(nv), max(1, 1024 // bv))
        _gated_norm_kernel[(T, triton.cdiv(nv, hb))](o, z, weight, out, o.stride(0), z.stride(0), out.stride(0), eps,
                                                     NV=nv, HV=hv, BV=bv, HB=hb, num_warps=4, **pdl_args(z.device))
    return out
