"""The Gated DeltaNet's Triton kernels (neuron/kernels/deltanet.py) against the torch reference
(neuron/models/recurrence.py), run by Triton's interpreter on the CPU: the causal conv with its
state, the delta rule token after token and in chunks, each from and back into state slots, over
spans of the lengths a step mixes (decodes, short and long prompt chunks, an empty span), and the
gated RMS norm. The same kernels run compiled on the GPU: tests/test_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton")

from neuron.kernels import conv as CONV  # noqa: E402
from neuron.kernels import deltanet as K  # noqa: E402
from neuron.models import recurrence as R  # noqa: E402

SLOTS = 6  # the last is the scratch slot an empty span points at


def table(spans):
    return torch.tensor(spans, dtype=torch.int64).T.contiguous()


def step(lengths, width, seed):
    """Rows for spans of ``lengths`` (0: an empty span) in slots 4, 0, 2, ... and their table."""
    g = torch.Generator().manual_seed(seed)
    spans, row = [], 0
    for i, n in enumerate(lengths):
        spans.append((row, n, (4 - 2 * i) % (SLOTS - 1) if n else SLOTS - 1))
        row += n
    return torch.randn(row, width, generator=g), spans, g


@pytest.mark.parametrize("lengths", [[1, 1, 1], [3, 1, 2], [5, 40, 1, 0], [70, 2], [33]])
@pytest.mark.parametrize("bias", [True, False])
def test_the_causal_conv_equals_the_reference_and_keeps_the_last_inputs(lengths, bias):
    C, k = 40, 4
    x, spans, g = step(lengths, C, sum(lengths) + bias)
    weight = torch.randn(C, k, generator=g)
    b = torch.randn(C, generator=g) if bias else None
    state = torch.randn(SLOTS, C, k - 1, generator=g)
    want_state = state.clone()
    want = R.causal_conv(x, weight, b, want_state, [s for s in spans if s[1]])
    got = CONV.causal_conv(x, weight, b, state, table(spans), max(lengths))
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(state, want_state, atol=1e-6)


def qkv_case(lengths, nk, r, hk, hv, seed, state_dtype=torch.float32):
    nv = nk * r
    qkv, spans, g = step(lengths, 2 * nk * hk + nv * hv, seed)
    ab = torch.randn(qkv.shape[0], 2 * nv, generator=g)  # a and b as strided views of one projection
    neg_a = -torch.rand(nv, generator=g) * 2
    dt_bias = torch.randn(nv, generator=g)
    state = (torch.randn(SLOTS, nv, hk, hv, generator=g) * 0.5).to(state_dtype)
    return qkv, ab[:, :nv], ab[:, nv:], neg_a, dt_bias, state, spans


@pytest.mark.parametrize("lengths, nk, r, hk, hv", [([1, 1, 1], 2, 2, 16, 32), ([3, 1, 0, 2], 1, 3, 32, 16),
                                                     ([1], 3, 1, 16, 16)])
def test_the_recurrent_delta_rule_equals_the_reference(lengths, nk, r, hk, hv):
    qkv, a, b, neg_a, dt_bias, state, spans = qkv_case(lengths, nk, r, hk, hv, len(lengths) * hk)
    want_state = state.clone()
    want = R.delta_rule(qkv, a, b, neg_a, dt_bias, want_state, [s for s in spans if s[1]], r)
    got = K.delta_rule_recurrent(qkv, a, b, neg_a, dt_bias, state, table(spans), r)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert torch.allclose(state, want_state, atol=1e-4)


def chunked(qkv, a, b, neg_a, dt_bias, state, spans, r, snaps=()):
    from neuron.runner.inputs import chunk_tables

    tables = [torch.from_numpy(t) for t in chunk_tables(spans, list(snaps), chunks_to=40, snaps_to=6)]
    return K.delta_rule(qkv, a, b, neg_a, dt_bias, state, tables[0], tables[1], r), tables[2]


@pytest.mark.parametrize("lengths, nk, r, hk, hv", [([70, 1, 130], 1, 2, 16, 32), ([64, 0, 5], 2, 1, 32, 16)])
def test_the_chunked_delta_rule_equals_the_reference(lengths, nk, r, hk, hv):
    qkv, a, b, neg_a, dt_bias, state, spans = qkv_case(lengths, nk, r, hk, hv, sum(lengths))
    want_state = state.clone()
    want = R.delta_rule(qkv, a, b, neg_a, dt_bias, want_state, [s for s in spans if s[1]], r)
    got, _ = chunked(qkv, a, b, neg_a, dt_bias, state, spans, r)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert torch.allclose(state, want_state, atol=1e-4), (state - want_state).abs().max()


@pytest.mark.parametrize("low", [False, True])
def test_a_16_bit_model_keeps_its_chunk_scratch_in_16_bits_within_their_rounding(low, monkeypatch):
    """A bfloat16 model's scratch between the two chunk kernels is bfloat16, and (``low``) the scan's
    products take the state and new values in bfloat16 too: the error is that rounding's, not a
    wrong term (which would be of the order of the values)."""
    monkeypatch.setitem(K.SCAN, "low", low)
    lengths, nk, r, hk, hv = [70, 1, 40], 1, 2, 16, 32
    qkv, a, b, neg_a, dt_bias, state, spans = qkv_case(lengths, nk, r, hk, hv, 5)
    # As in the model: q/k/v come from the conv in float32, a and b from the projection in bfloat16.
    a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    wide_state, want_state = state.clone(), state.clone()
    want = R.delta_rule(qkv, a.float(), b.float(), neg_a, dt_bias, want_state, spans, r)
    got, _ = chunked(qkv, a, b, neg_a, dt_bias, state, spans, r)
    wide, _ = chunked(qkv, a.float(), b.float(), neg_a, dt_bias, wide_state, spans, r)
    scale = want.abs().max()
    assert (got - want).abs().max() < 3e-2 * scale and (state - want_state).abs().max() < 3e-2 * want_state.abs().max()
    assert (wide - want).abs().max() < 1e-4 * scale
    assert not torch.equal(got, wide)  # the 16-bit path did run (the float32 one gives the reference's values)


def test_snapshots_inside_a_chunk_at_its_edge_and_at_the_end_hold_the_state_there():
    """A snapshot after 37 tokens (mid-chunk), after 64 (a chunk's edge) and after the last token,
    of the conv state and the delta rule's: what the sequence's state was at that point (the
    reference runs the span in pieces to get it)."""
    lengths, nk, r, hk, hv = [100, 3, 1], 1, 2, 16, 16
    qkv, a, b, neg_a, dt_bias, state, spans = qkv_case(lengths, nk, r, hk, hv, 9)
    snaps = [(0, 37, 1), (0, 64, 3), (1, 3, 5), (2, 1, 2)]  # (span, tokens before, slot); slot 5: scratch
    want_state = state.clone()
    want = R.delta_rule(qkv, a, b, neg_a, dt_bias, want_state, spans, r, snaps)
    got, conv_snaps = chunked(qkv, a, b, neg_a, dt_bias, state, spans, r, snaps)
    assert torch.allclose(got, want, atol=1e-4) and torch.allclose(state, want_state, atol=1e-4)
    first, _, slot = spans[0]
    one = qkv_case(lengths, nk, r, hk, hv, 9)[5]  # the states before the step, again
    for at, dst in ((37, 1), (64, 3)):
        piece = one.clone()
        R.delta_rule(qkv, a, b, neg_a, dt_bias, piece, [(first, at, slot)], r)
        assert torch.allclose(state[dst], piece[slot], atol=1e-4), at
    C, k = qkv.shape[1], 4
    conv_state = torch.randn(SLOTS, C, k - 1)
    want_conv = conv_state.clone()
    weight = torch.randn(C, k)
    R.causal_conv(qkv, weight, None, want_conv, spans, snaps)
    CONV.conv_snapshots(qkv, conv_state, conv_snaps)
    CONV.causal_conv(qkv, weight, None, conv_state, table(spans), max(lengths))
    assert torch.allclose(conv_state, want_conv, atol=1e-6)


def test_a_bfloat16_state_is_read_and_written_in_its_dtype():
    qkv, a, b, neg_a, dt_bias, state, spans = qkv_case([1, 1], 1, 2, 16, 16, 7, torch.bfloat16)
    want_state = state.clone()
    want = R.delta_rule(qkv, a, b, neg_a, dt_bias, want_state, spans, 2)
    got = K.delta_rule_recurrent(qkv, a, b, neg_a, dt_bias, state, table(spans), 2)
    assert state.dtype == torch.bfloat16
    assert torch.allclose(got, want, atol=1e-4)
    assert (state.float() - want_state.float()).abs().max() <= 2 ** -7 * want_state.float().abs().max()


# float32 only: the interpreter's conversions to bfloat16 truncate where the GPU's round to nearest
# (the GPU test runs the bfloat16 model).
@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("heads, hv", [(3, 32), (12, 128), (1, 16)])  # whole programs, a part-filled one
def test_the_gated_norm_equals_the_reference(dtype, heads, hv):
    g = torch.Generator().manual_seed(5)
    o = torch.randn(5, heads * hv, generator=g)
    zx = torch.randn(5, (heads + 1) * hv, generator=g).to(dtype)
    weight = torch.randn(hv, generator=g).to(dtype)
    z = zx[:, hv:]  # a strided view, as the projection's slice
    want = R.gated_rms_norm(o, z, weight, 1e-6)
    got = K.gated_rms_norm(o, z, weight, 1e-6)
    assert got.dtype == dtype and torch.allclose(got, want, atol=1e-5)


def test_the_causal_conv_leaves_rows_of_no_span_alone_as_a_prefill_graph_pads_them():
    """A prefill graph's step has more rows than its spans hold, and empty spans of a scratch slot;
    the rows kernel (spans longer than a tile) finds each row's span and leaves padding alone."""
    C, k = 40, 4
    x, spans, g = step([40, 1, 0, 3], C, 5)
    pad = torch.randn(9, C, generator=g)
    weight = torch.randn(C, k, generator=g)
    state = torch.randn(SLOTS, C, k - 1, generator=g)
    want_state = state.clone()
    want = R.causal_conv(x, weight, None, want_state, [s for s in spans if s[1]])
    out = torch.full((x.shape[0] + 9, C), 7.0)
    got = CONV.causal_conv(torch.cat([x, pad]), weight, None, state, table(spans), 40, out=out)
    assert torch.allclose(got[: x.shape[0]], want, atol=1e-5) and torch.allclose(state, want_state, atol=1e-6)
    assert (got[x.shape[0]:] == 7.0).all()
