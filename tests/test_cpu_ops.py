"""The CPU step's fused C++ ops (neuron/kernels/csrc/ops.h, attention.h), at every
instruction-set level this machine runs, against their torch references, on the shapes the model
gives them: q a strided view of qkv, grouped and ungrouped KV heads (an uneven tensor-parallel
split), sequences scattered over the paged cache."""

from __future__ import annotations

import pytest
import torch

from attention_reference import reference_decode, rope_case
from neuron.kernels.cpu import KernelUnavailable, load_level
from neuron.kernels.isa import runnable
from neuron.models.ops import TorchOps

OPS = TorchOps()


@pytest.fixture(params=[level.name for level in runnable()])
def C(request):
    try:
        return load_level(request.param)
    except KernelUnavailable as exc:  # not built (no compiler at install): the torch ops run instead
        pytest.skip(str(exc))


@pytest.mark.parametrize("n_q,n_kv,hd,bs,uniform", [(9, 3, 64, 16, True), (8, 2, 16, 16, True),
                                                    (5, 2, 16, 16, False), (4, 4, 24, 8, True)])
def test_paged_decode_attends_each_sequence_over_its_own_blocks(C, n_q, n_kv, hd, bs, uniform):
    g = torch.Generator().manual_seed(n_q * 100 + hd)
    blocks, max_blocks = 60, 12
    kc = torch.randn(blocks, bs, n_kv, hd, generator=g)
    vc = torch.randn(blocks, bs, n_kv, hd, generator=g)
    tables = torch.randperm(blocks, generator=g)[: 5 * max_blocks].view(5, max_blocks).int()
    slots = torch.tensor([4, 0, 2])
    ctx = torch.tensor([1, 7, max_blocks * bs - 3])
    qkv = torch.randn(3, n_q + 2 * n_kv, hd, generator=g)
    q = qkv[:, :n_q]
    kv_of_q = torch.arange(n_q) // (n_q // n_kv) if uniform else torch.arange(n_q) * n_kv // n_q
    scale = hd ** -0.5
    out = C.paged_decode(q, kc, vc, tables, slots, ctx, kv_of_q.int(), scale)
    assert (out.double() - reference_decode(q, kc, vc, tables, slots, ctx, kv_of_q, scale)).abs().max() < 1e-5


@pytest.mark.parametrize("n_q,n_kv,hd", [(9, 3, 64), (8, 2, 128), (4, 2, 32), (4, 4, 24), (6, 3, 48)])
def test_a_prompt_s_rows_get_the_bits_each_gets_alone(C, n_q, n_kv, hd):
    """Runs of rows of one slot whose contexts grow by one (prompt chunks, a token and its drafts)
    beside decodes and each other: each row is the same bits as that row's query alone, whatever
    tile of the run it falls in, and the attention of its own keys."""
    g = torch.Generator().manual_seed(hd)
    bs, blocks, max_blocks = 16, 80, 16
    kc = torch.randn(blocks, bs, n_kv, hd, generator=g)
    vc = torch.randn(blocks, bs, n_kv, hd, generator=g)
    tables = torch.randperm(blocks, generator=g)[: 5 * max_blocks].view(5, max_blocks).int()
    # (slot, first context, rows): runs of 1 to 9 rows, a prompt from its start, one after a
    # cached prefix, rows of one slot whose contexts do not follow on, a long run (threads)
    runs = [(0, 1, 9), (3, 40, 1), (1, 17, 5), (2, 5, 3), (2, 30, 2), (4, 100, 7), (3, 200, 4), (0, 11, 150)]
    slots = torch.tensor([s for s, _, n in runs for _ in range(n)])
    ctx = torch.tensor([c + i for _, c, n in runs for i in range(n)])
    q = torch.randn(len(slots), n_q + 2 * n_kv, hd, generator=g)[:, :n_q]
    kv_of_q = (torch.arange(n_q) // (n_q // n_kv)).int()
    scale = hd ** -0.5
    out = C.paged_decode(q, kc, vc, tables, slots, ctx, kv_of_q, scale)
    for b in range(len(slots)):
        alone = C.paged_decode(q[b: b + 1], kc, vc, tables, slots[b: b + 1], ctx[b: b + 1], kv_of_q, scale)
        assert torch.equal(out[b: b + 1], alone), f"row {b}"
    reference = reference_decode(q, kc, vc, tables, slots, ctx, kv_of_q.long(), scale)
    assert (out.double() - reference).abs().max() < 1e-5


def test_paged_decode_refuses_a_table_entry_outside_the_cache(C):
    kc = torch.zeros(4, 16, 1, 16)
    tables = torch.tensor([[0, 9]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        C.paged_decode(torch.zeros(1, 1, 16), kc, kc, tables, torch.tensor([0]), torch.tensor([20]),
                       torch.zeros(1, dtype=torch.int32), 0.25)


@pytest.mark.parametrize("rows", [3, 300])  # few rows run serially, many in parallel
def test_fused_norms_and_silu_match_the_reference(C, rows):
    g = torch.Generator().manual_seed(rows)
    x, r, w = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g), torch.randn(576, generator=g)
    assert (C.rms_norm(x, w, 1e-5) - OPS.rms_norm(x, w, 1e-5)).abs().max() < 1e-5
    ref, ref_r = OPS.add_rms_norm(x, r, w, 1e-5)
    out, got_r = C.add_rms_norm(x, r, w, 1e-5)
    assert got_r.data_ptr() == r.data_ptr() and (got_r - ref_r).abs().max() < 1e-6
    assert (out - ref).abs().max() < 1e-5
    gu = torch.randn(rows, 2 * 1536, generator=g)
    ref = OPS.silu_mul(gu)
    assert ((C.silu_mul(gu) - ref).abs() / ref.abs().clamp_min(1)).max() < 1e-6


@pytest.mark.parametrize("norm", [False, True])
def test_rope_store_rotates_queries_in_place_and_puts_keys_and_values_in_their_cache_rows(C, norm):
    c = rope_case(norm)
    got, (kc, vc) = c.qkv.clone(), c.caches()
    C.rope_store(got, c.n_q, c.n_kv, c.pos, c.cos, c.sin, c.qn, c.kn, 1e-6, kc, vc, c.rows)
    c.check(got, kc, vc)
    with pytest.raises(RuntimeError, match="out of range"):
        C.rope_store(got, c.n_q, c.n_kv, torch.tensor([0, 5, 99]), c.cos, c.sin, c.qn, c.kn, 1e-6, kc, vc, c.rows)
