"""The Gated DeltaNet's causal depthwise conv over q/k/v (Triton), with its conv state: a
sequence's last ``K - 1`` inputs. Spans as in ``deltanet``: a [3, S] int64 table of each
sequence's first token row, tokens and state slot. Checked against neuron/models/recurrence.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import grid_sync, pdl_args, pow2


@triton.jit(do_not_specialize=["span_stride"])  # one compile for every count of spans
def _conv_kernel(X, W, Bias, State, Out, Spans, span_stride, stride_x, stride_o, stride_slot, C,
                 K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PDL: tl.constexpr):
    """out[t, c] = silu(bias[c] + sum_i w[c, i] * x[t - K + 1 + i, c]) over a span's rows, the
    inputs before its first row from the conv state (state[slot, c, K - 1 + j] is input j < 0).
    This program holds its whole span (every span fits one token tile), so it also leaves the
    last K - 1 inputs in the state."""
    s = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    grid_sync(PDL)
    row = tl.load(Spans + s)
    n = tl.load(Spans + span_stride + s)
    slot = tl.load(Spans + 2 * span_stride + s)
    t = tl.arange(0, BT)
    tm = t < n
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    st = State + slot * stride_slot + c[None, :] * (K - 1)
    for i in tl.static_range(K):
        j = t - (K - 1) + i
        xr = tl.load(X + (row + j)[:, None] * stride_x + c[None, :], mask=((j >= 0) & tm)[:, None] & cm[None, :],
                     other=0.0)
        xs = tl.load(st + (K - 1 + j)[:, None], mask=((j < 0) & tm)[:, None] & cm[None, :], other=0.0)
        w = tl.load(W + c * K + i, mask=cm, other=0.0)
        acc += (xr.to(tl.float32) + xs.to(tl.float32)) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + c, mask=cm, other=0.0)[None, :]
    acc = acc * tl.sigmoid(acc)
    tl.store(Out + (row + t)[:, None] * stride_o + c[None, :], acc, mask=tm[:, None] & cm[None, :])
    if n > 0:
        _conv_keep(X, State, row, n, slot, c, cm, stride_x, stride_slot, K, KP)


# Not specialised on the step's sizes: one compile serves the prefill graphs and the eager steps
# of one long span (S == 1 would compile a kernel of its own at the first long prompt).
@triton.jit(do_not_specialize=["span_stride", "S", "T"])
def _conv_rows_kernel(X, W, Bias, State, Out, Spans, span_stride, S, T, stride_x, stride_o, stride_slot, C,
                      K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
                      PDL: tl.constexpr):
    """``_conv_kernel``'s output for a step with long spans, a program per tile of the step's rows
    (whichever spans they belong to) rather than per span and tile: a prompt chunk beside many
    decodes (and a graph's empty spans) would launch a program per span for each of the longest
    span's tiles. Each row finds its span in the table; rows of none are left alone."""
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    grid_sync(PDL)
    first = tl.full((BT,), -1, tl.int64)
    slot = tl.zeros((BT,), tl.int64)
    for s in range(S):
        row = tl.load(Spans + s)
        n = tl.load(Spans + span_stride + s)
        inside = (r >= row) & (r < row + n)
        first = tl.where(inside, row, first)
        slot = tl.where(inside, tl.load(Spans + 2 * span_stride + s), slot)
    rm = (first >= 0) & (r < T)
    t = r - first
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    st = State + slot[:, None] * stride_slot + c[None, :] * (K - 1)
    for i in tl.static_range(K):
        j = t - (K - 1) + i
        xr = tl.load(X + (r - (K - 1) + i)[:, None] * stride_x + c[None, :],
                     mask=((j >= 0) & rm)[:, None] & cm[None, :], other=0.0)
        xs = tl.load(st + (K - 1 + j)[:, None], mask=((j < 0) & rm)[:, None] & cm[None, :], other=0.0)
        w = tl.load(W + c * K + i, mask=cm, other=0.0)
        acc += (xr.to(tl.float32) + xs.to(tl.float32)) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + c, mask=cm, other=0.0)[None, :]
    acc = acc * tl.sigmoid(acc)
    tl.store(Out + r[:, None] * stride_o + c[None, :], acc, mask=rm[:, None] & cm[None, :])


@triton.jit
def _conv_keep(X, State, row, n, slot, c, cm, stride_x, stride_slot, K: tl.constexpr, KP: tl.constexpr):
    """The span's last K - 1 inputs (from the old state where the span is shorter) into its slot."""
    m = tl.arange(0, KP)
    mm = m < K - 1
    j = n - (K - 1) + m
    st = State + slot * stride_slot + c[:, None] * (K - 1)
    both = cm[:, None] & mm[None, :]
    from_x = tl.load(X + (row + j)[None, :] * stride_x + c[:, None], mask=both & (j >= 0)[None, :], other=0.0)
    from_s = tl.load(st + (K - 1 + j)[None, :], mask=both & (j < 0)[None, :], other=0.0)
    kept = tl.where((j >= 0)[None, :], from_x.to(tl.float32), from_s.to(tl.float32))
    tl.store(st + m[None, :], kept.to(State.dtype.element_ty), mask=both)


@triton.jit(do_not_specialize=["span_stride"])
def _conv_keep_kernel(X, State, Spans, span_stride, stride_x, stride_slot, C, K: tl.constexpr, KP: tl.constexpr,
                      BC: tl.constexpr, PDL: tl.constexpr):
    s = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    grid_sync(PDL)
    row = tl.load(Spans + s)
    n = tl.load(Spans + span_stride + s)
    slot = tl.load(Spans + 2 * span_stride + s)
    if n > 0:
        _conv_keep(X, State, row, n, slot, c, c < C, stride_x, stride_slot, K, KP)


ROWS_TILE = (32, 128, 4)  # _conv_rows_kernel's (rows, channels, warps): scripts/bench-kernels --prefill-ops


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                spans: torch.Tensor, max_n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(causal depthwise conv) of each span's rows of ``x`` [T, C] (rows contiguous) after the
    inputs its ``state`` [slots, C, K - 1] slot remembers, which then remembers the span's last
    K - 1; float32 [T, C]. ``weight`` [C, K] float32; ``spans`` [3, S] int64 (rows contiguous);
    ``max_n``: a bound on the spans' tokens."""
    T, C = x.shape
    K = weight.shape[1]
    S = spans.shape[1]
    assert (S == 1 or spans.stride(1) == 1) and x.stride(1) == 1
    out = torch.empty(T, C, dtype=torch.float32, device=x.device) if out is None else out
    if not S or not T:
        return out
    BT = min(pow2(max_n), 32)
    BC = 128 if BT <= 4 else 64
    b = bias if bias is not None else weight
    if max_n <= BT:  # a tile a span (decodes): the state moves on in the same program
        _conv_kernel[(S, triton.cdiv(C, BC))](x, weight, b, state, out, spans, spans.stride(0), x.stride(0),
                                              out.stride(0), state.stride(0), C, K=K, KP=pow2(K - 1), BT=BT, BC=BC,
                                              HAS_BIAS=bias is not None, num_warps=4, **pdl_args(x.device))
        return out
    BT, BC, warps = ROWS_TILE
    _conv_rows_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](
        x, weight, b, state, out, spans, spans.stride(0), S, T, x.stride(0), out.stride(0), state.stride(0), C,
        K=K, BT=BT, BC=BC, HAS_BIAS=bias is not None, num_warps=warps, **pdl_args(x.device))
    _conv_keep_kernel[(S, triton.cdiv(C, 128))](x, state, spans, spans.stride(0), x.stride(0), state.stride(0),
                                                C, K=K, KP=pow2(K - 1), BC=128, num_warps=4, **pdl_args(x.device))
    return out


@triton.jit(do_not_specialize=["snap_stride"])
def _conv_snapshot_kernel(X, State, Snaps, snap_stride, stride_x, stride_slot, C, K: tl.constexpr,
                          KP: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    """The conv state a sequence has after a snapshot point: the K - 1 inputs before it, from the
    step's rows where they are this step's and from the sequence's state slot where they came
    before (read before the conv kernel moves it on)."""
    m = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    grid_sync(PDL)
    point = tl.load(Snaps + m)
    first = tl.load(Snaps + snap_stride + m)
    slot = tl.load(Snaps + 2 * snap_stride + m)
    dst = tl.load(Snaps + 3 * snap_stride + m)
    if dst >= 0:
        i = tl.arange(0, KP)
        im = i < K - 1
        j = point - (K - 1) + i
        both = cm[:, None] & im[None, :]
        from_x = tl.load(X + j[None, :] * stride_x + c[:, None], mask=both & (j >= first)[None, :], other=0.0)
        old = State + slot * stride_slot + c[:, None] * (K - 1) + (K - 1 + j - first)[None, :]
        from_s = tl.load(old, mask=both & (j < first)[None, :], other=0.0)
        kept = tl.where((j >= first)[None, :], from_x.to(tl.float32), from_s.to(tl.float32))
        tl.store(State + dst * stride_slot + c[:, None] * (K - 1) + i[None, :], kept.to(State.dtype.element_ty),
                 mask=both)


def conv_snapshots(x: torch.Tensor, state: torch.Tensor, snaps: torch.Tensor) -> None:
    """For each snapshot ``snaps`` [4, M] int64 (the step row of the first token after the point,
    the sequence's first row in the step, its state slot, and the slot that takes the snapshot,
    or -1): the conv state after the point. Launched before ``causal_conv`` of the same rows."""
    M, C, K = snaps.shape[1], x.shape[1], state.shape[2] + 1
    if M:
        assert M == 1 or snaps.stride(1) == 1
        _conv_snapshot_kernel[(M, triton.cdiv(C, 128))](x, state, snaps, snaps.stride(0), x.stride(0), state.stride(0),
                                                        C, K=K, KP=pow2(K - 1), BC=128, num_warps=4,
                                                        **pdl_args(x.device))
