"""Device-side token handling in the step (Triton): greedy tokens for the decode graph, and the
device tokens (-1) of a step resolved to each slot's last draw."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import grid_sync, pdl_args, pow2


# ---------------------------------------------------------------------------------------------
# Greedy tokens in the decode graph: each row's argmax over the vocabulary, in two launches (parts
# of a row, then the parts), instead of torch's reduction (one launch of ~19 programs, 7.6 us of
# an H200's q4 step) and the scatter of the tokens into the slots' last draws after it.


@triton.jit
def _argmax_combine(v1, i1, v2, i2):
    """The larger of two (value, index) pairs as torch.argmax picks: NaN above everything, and
    of equal values (or two NaNs) the first index."""
    nan1 = v1 != v1
    nan2 = v2 != v2
    first = (nan1 & ~nan2) | (~nan1 & ~nan2 & (v1 > v2)) | (((v1 == v2) | (nan1 & nan2)) & (i1 < i2))
    return tl.where(first, v1, v2), tl.where(first, i1, i2)


@triton.jit
def _argmax_parts_kernel(X, PV, PI, V, stride_x, PARTS, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """Row ``program_id(0)``'s argmax over columns [p * CHUNK, (p + 1) * CHUNK) of ``V``, part
    ``p = program_id(1)``, into ``PV``/``PI`` [rows, PARTS]."""
    grid_sync(PDL)
    r = tl.program_id(0)
    p = tl.program_id(1)
    best_v = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = tl.full((BLOCK,), 2147483647, tl.int32)
    for c0 in tl.static_range(0, CHUNK, BLOCK):
        i = p * CHUNK + c0 + tl.arange(0, BLOCK)
        x = tl.load(X + r * stride_x + i, mask=i < V, other=float("-inf")).to(tl.float32)
        best_v, best_i = _argmax_combine(x, i, best_v, best_i)
    v, i = tl.reduce((best_v, best_i), 0, _argmax_combine)
    tl.store(PV + r * PARTS + p, v)
    tl.store(PI + r * PARTS + p, i)


@triton.jit
def _argmax_final_kernel(PV, PI, Tokens, Slots, Sampled, Last, PARTS, P_PAD: tl.constexpr, PDL: tl.constexpr):
    """Row ``program_id(0)``'s token from its parts; stored as its slot's last draw too where the
    row is ``Sampled``."""
    grid_sync(PDL)
    r = tl.program_id(0)
    j = tl.arange(0, P_PAD)
    ok = j < PARTS
    v = tl.load(PV + r * PARTS + j, mask=ok, other=float("-inf"))
    i = tl.load(PI + r * PARTS + j, mask=ok, other=2147483647)
    _, token = tl.reduce((v, i), 0, _argmax_combine)
    token = token.to(tl.int64)
    tl.store(Tokens + r, token)
    tl.store(Last + tl.load(Slots + r), token, mask=tl.load(Sampled + r) != 0)


ARGMAX_CHUNK, ARGMAX_BLOCK = 2048, 1024  # columns a program, columns a program step


def greedy_tokens(logits: torch.Tensor, slots: torch.Tensor, sampled: torch.Tensor,
                  last: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` [R] (int64) of float32 ``logits`` [R, V] (rows of unit stride), and
    ``last[slots[r]] = token`` for the rows whose ``sampled`` is not 0 (the sampler's last draw of
    each slot, which a device token in the next step resolves to)."""
    R, V = logits.shape
    assert logits.stride(1) == 1 and R <= slots.shape[0] and R <= sampled.shape[0]
    parts = triton.cdiv(V, ARGMAX_CHUNK)
    pv = torch.empty(R, parts, device=logits.device, dtype=torch.float32)
    pi = torch.empty(R, parts, device=logits.device, dtype=torch.int32)
    tokens = torch.empty(R, device=logits.device, dtype=torch.int64)
    _argmax_parts_kernel[(R, parts)](logits, pv, pi, V, logits.stride(0), parts, CHUNK=ARGMAX_CHUNK,
                                     BLOCK=ARGMAX_BLOCK, num_warps=4, **pdl_args(logits.device))
    _argmax_final_kernel[(R,)](pv, pi, tokens, slots, sampled, last, parts, P_PAD=pow2(parts), num_warps=1,
                               **pdl_args(logits.device))
    return tokens


@triton.jit(do_not_specialize=["T"])  # one compile for every step length
def _resolve_kernel(Ids, Slots, Last, Out, T, BLOCK: tl.constexpr, PDL: tl.constexpr):
    grid_sync(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < T
    ids = tl.load(Ids + i, mask=ok, other=0)
    device = ok & (ids < 0)
    last = tl.load(Last + tl.load(Slots + i, mask=device, other=0), mask=device, other=0)
    tl.store(Out + i, tl.where(device, last, ids), mask=ok)


def resolve_tokens(ids: torch.Tensor, slots: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``torch.where(ids >= 0, ids, last[slots])`` in one launch: a step's device tokens (-1)
    become their slot's last draw."""
    T = ids.shape[0]
    out = torch.empty_like(ids)
    _resolve_kernel[(triton.cdiv(T, 512),)](ids, slots, last, out, T, BLOCK=512, num_warps=4,
                                            **pdl_args(ids.device))
    return out

