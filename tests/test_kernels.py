"""The Triton kernels of the GPU fast path against their torch references, run by Triton's
interpreter on the CPU (the same kernels run compiled on the GPU: tests/test_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton")

from neuron.models.ops import TorchOps  # noqa: E402
from neuron.kernels import fused  # noqa: E402
from neuron.kernels import gpu as K  # noqa: E402
from attention_reference import reference_decode, reference_prefill, rope_case  # noqa: E402

OPS = TorchOps()


SHAPES = [(8, 2, 16, 16, True), (6, 3, 32, 8, True), (5, 2, 16, 16, False), (4, 4, 64, 16, True), (4, 2, 24, 16, True)]


# Every head shape whole and split in 4; 16 splits (more than a context has tiles: the splits past
# its end merge nothing) on a grouped and an ungrouped shape, as the merge does not depend on it.
@pytest.mark.parametrize("n_q,n_kv,hd,bs,uniform,splits", [(*shape, splits) for shape in SHAPES for splits in (1, 4)]
                         + [(*SHAPES[1], 16), (*SHAPES[2], 16)])
def test_paged_decode_attends_each_sequence_over_its_own_blocks(n_q, n_kv, hd, bs, uniform, splits):
    g = torch.Generator().manual_seed(n_q * 100 + hd + splits)
    blocks, max_blocks = 60, 12
    kc = torch.randn(blocks, bs, n_kv, hd, generator=g)
    vc = torch.randn(blocks, bs, n_kv, hd, generator=g)
    tables = torch.randperm(blocks, generator=g)[: 5 * max_blocks].view(5, max_blocks).int()
    slots = torch.tensor([4, 0, 2])
    ctx = torch.tensor([1, 7, max_blocks * bs - 3], dtype=torch.int32)
    qkv = torch.randn(3, n_q + 2 * n_kv, hd, generator=g)  # q is a strided view, as in the model
    q = qkv[:, :n_q]
    if uniform:
        kv_of_q, repeat = torch.arange(n_q) // (n_q // n_kv), n_q // n_kv
    else:
        kv_of_q, repeat = torch.arange(n_q) * n_kv // n_q, 0
    scale = hd ** -0.5
    counters = torch.zeros(3 * n_q, dtype=torch.int32)
    ref = reference_decode(q, kc, vc, tables, slots, ctx, kv_of_q, scale)
    for _ in range(2):  # the split counters are left ready for the next launch
        out = K.paged_decode(q, kc, vc, tables, slots, ctx, kv_of_q.int(), repeat, scale, splits, counters)
        assert (out.double() - ref).abs().max() < 1e-5 and not counters.any()
    # a decode graph gives the positions instead: each context is one more
    out = K.paged_decode(q, kc, vc, tables, slots, None, kv_of_q.int(), repeat, scale, splits, counters,
                         positions=(ctx - 1).long())
    assert (out.double() - ref).abs().max() < 1e-5 and not counters.any()


@pytest.mark.parametrize("splits", [3, 16])
def test_paged_decode_splits_each_context_by_its_own_length(splits):
    """One launch of 16 splits serves contexts of one key up to several tiles, each split evenly
    by its own length (the splits past its end merge nothing); one of 3 splits gives each part
    several tiles."""
    g = torch.Generator().manual_seed(splits)
    n_q, n_kv, hd, bs, per_seq = 8, 2, 32, 16, 40
    kc, vc = (torch.randn(4 * per_seq, bs, n_kv, hd, generator=g) for _ in range(2))
    tables = torch.randperm(4 * per_seq, generator=g).view(4, per_seq).int()
    ctx = torch.tensor([1, 130, 300, per_seq * bs - 5], dtype=torch.int32)
    q = torch.randn(4, n_q, hd, generator=g)
    kv_of_q = torch.arange(n_q) // (n_q // n_kv)
    slots = torch.tensor([3, 1, 0, 2])
    counters = torch.zeros(4 * n_q, dtype=torch.int32)
    ref = reference_decode(q, kc, vc, tables, slots, ctx, kv_of_q, hd ** -0.5)
    for _ in range(2):
        out = K.paged_decode(q, kc, vc, tables, slots, ctx, kv_of_q.int(), n_q // n_kv, hd ** -0.5, splits, counters)
        assert (out.double() - ref).abs().max() < 1e-5 and not counters.any()


def test_split_count_covers_the_gpu_once_without_splits_shorter_than_a_tile():
    assert K.decode_splits(1, 8, 4096, 132) == 16
    assert K.decode_splits(1, 8, 100, 132) == 2
    assert K.decode_splits(4, 8, 4096, 132) == 4
    assert K.decode_splits(64, 8, 4096, 132) == 1


# (first row in q, tokens, table row, start position): a whole prompt; a chunk after a cached
# prefix, starting mid-block and crossing blocks; a single token; a chunk after a block-aligned
# prefix, long enough for two query tiles. Row 99 belongs to no chunk (a decode row).
SPANS = [(0, 5, 3, 0), (5, 23, 0, 37), (28, 1, 2, 70), (29, 70, 1, 16)]


def prefill_case(n_q, n_kv, hd, uniform, dtype, seed):
    """A cache [40 blocks of 16] that is NaN wherever no chunk's key is (so a read past a
    sequence's keys shows), shuffled block tables, and q as a strided view of qkv."""
    g = torch.Generator().manual_seed(seed)
    bs, max_blocks = 16, 8
    tables = torch.randperm(40, generator=g)[: 4 * max_blocks].view(4, max_blocks).int()
    kc = torch.full((40, bs, n_kv, hd), float("nan"))
    vc = torch.full((40, bs, n_kv, hd), float("nan"))
    for _, n, slot, start in SPANS:
        pos = torch.arange(start + n)
        block = tables[slot, pos // bs].long()
        kc[block, pos % bs] = torch.randn(len(pos), n_kv, hd, generator=g)
        vc[block, pos % bs] = torch.randn(len(pos), n_kv, hd, generator=g)
    q = torch.randn(100, n_q + 2 * n_kv, hd, generator=g)[:, :n_q]
    if uniform:
        kv_of_q, repeat = torch.arange(n_q) // (n_q // n_kv), n_q // n_kv
    else:
        kv_of_q, repeat = torch.arange(n_q) * n_kv // n_q, 0
    return q.to(dtype), kc.to(dtype), vc.to(dtype), tables, kv_of_q, repeat


# (6, 1): a group of 6, as the 27B hybrid's, whose tiles of (query, head) rows start mid-query
PREFILL_SHAPES = [(4, 2, 48, True), (4, 4, 64, True), (8, 2, 128, True), (5, 2, 80, False), (6, 1, 32, True),
                  (8, 1, 256, True)]
PREFILL_MODES = [(torch.float32, False), (torch.float16, False), (torch.float32, True)]


# Every shape with both splits, and every mode (dtype, work list) with both splits on two shapes
# each, rather than the whole product (36 cases: 47 s of the interpreter on 2 cores).
@pytest.mark.parametrize("n_q,n_kv,hd,uniform,dtype,work", [(*shape, *PREFILL_MODES[i % len(PREFILL_MODES)])
                                                            for i, shape in enumerate(PREFILL_SHAPES)])
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_prefill_attends_each_chunk_causally_after_its_cached_prefix(n_q, n_kv, hd, uniform, dtype, splits,
                                                                           work):
    """``work``: over a prefill graph's work list (one program per tile there is), with two spans
    of no tokens (a graph's table is padded) and items to spare."""
    q, kc, vc, tables, kv_of_q, repeat = prefill_case(n_q, n_kv, hd, uniform, dtype, seed=n_q * 100 + hd)
    spans = torch.tensor(SPANS + [(0, 0, 0, 0)] * 2 if work else SPANS, dtype=torch.int32)
    items = None
    if work:
        ns = spans[:, 1].tolist()
        size = K.prefill_work_size(sum(ns), len(ns), repeat, hd, q.device)
        items = torch.from_numpy(K.prefill_work(ns, repeat, hd, q.device, size))
        assert (items >= 0).sum() < size
    scale = hd ** -0.5
    out = torch.full(q.shape, 7.0, dtype=dtype)
    # every range a key tile (min_split_keys 0): the contexts here are a few tiles long
    K.paged_prefill(q, kc, vc, tables, spans, kv_of_q.int(), repeat, scale, max(n for _, n, _, _ in SPANS), out,
                    splits, items, min_split_keys=0)
    spans = spans[: len(SPANS)]
    ref = reference_prefill(q, kc, vc, tables, spans, kv_of_q, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out[:99].double() - ref[:99]).abs().max() < tol
    # A row of no chunk: not written, or with key ranges split (a graph's padding) zeros.
    assert (out[99] == (7.0 if splits == 1 else 0.0)).all()


@pytest.mark.parametrize("min_keys", [512, 64])
def test_a_prefill_split_into_more_ranges_than_a_context_fills_merges_only_the_ranges_it_wrote(min_keys):
    """32 ranges of 512 keys at least over contexts of at most 93 keys: one range is written, 31
    are empty (never stored, never read). Of 64 keys: two."""
    q, kc, vc, tables, kv_of_q, repeat = prefill_case(8, 2, 64, True, torch.float32, seed=11)
    spans = torch.tensor(SPANS + [(0, 0, 0, 0)] * 2, dtype=torch.int32)
    ns = spans[:, 1].tolist()
    items = torch.from_numpy(K.prefill_work(ns, repeat, 64, q.device, K.prefill_work_size(sum(ns), len(ns), repeat, 64,
                                                                                         q.device)))
    out = torch.full(q.shape, 7.0)
    K.paged_prefill(q, kc, vc, tables, spans, kv_of_q.int(), repeat, 64 ** -0.5, max(ns), out, 32, items,
                    min_split_keys=min_keys)
    ref = reference_prefill(q, kc, vc, tables, spans[: len(SPANS)], kv_of_q, 64 ** -0.5)
    assert (out[:99].double() - ref[:99]).abs().max() < 1e-5 and (out[99] == 0).all()


def test_prefill_splits_give_every_multiprocessor_two_programs_when_the_tiles_alone_do_not():
    cpu = torch.device("cpu")  # tiles of 128 (query, head) rows at head dim 128
    assert K.prefill_splits(16, 4, 32, 128, 132, cpu) == 32  # one tile a KV head: 8 programs
    assert K.prefill_splits(128, 4, 32, 128, 132, cpu) == 8  # four tiles a KV head
    assert K.prefill_splits(512, 4, 32, 128, 132, cpu) == 2
    assert K.prefill_splits(2048, 4, 32, 128, 132, cpu) == 1
    assert K.prefill_splits(16, 0, 5, 80, 132, cpu) == 32  # heads of no uniform group: a program each


def test_a_chunk_query_sees_the_keys_up_to_its_own_position_and_none_after():
    # Every value is zero but the one at position 24, query 4 of a chunk starting at 20: queries
    # 0-3 must not see it, 4-7 must.
    hd, bs = 32, 16
    kc = torch.randn(4, bs, 1, hd, generator=torch.Generator().manual_seed(5))
    vc = torch.zeros(4, bs, 1, hd)
    tables = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    vc[0, 24 - bs] = 1.0
    q = torch.randn(8, 1, hd, generator=torch.Generator().manual_seed(6))
    spans = torch.tensor([[0, 8, 0, 20]], dtype=torch.int32)
    out = K.paged_prefill(q, kc, vc, tables, spans, torch.zeros(1, dtype=torch.int32), 1, hd ** -0.5, 8)
    assert (out[:4] == 0).all() and (out[4:] > 0).all()
    ref = reference_prefill(q, kc, vc, tables, spans, torch.zeros(1, dtype=torch.long), hd ** -0.5)
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_norms_match_the_reference(dtype):
    g = torch.Generator().manual_seed(2)
    x, r, w = (torch.randn(4, 96, generator=g).to(dtype), torch.randn(4, 96, generator=g).to(dtype),
               torch.randn(96, generator=g).to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (K.rms_norm(x, w, 1e-6)[0].float() - OPS.rms_norm(x, w, 1e-6).float()).abs().max() < tol
    r2 = r.clone()
    out, _ = K.rms_norm(x, w, 1e-6, r2)
    ref, ref_r = OPS.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(r2, ref_r) and (out.float() - ref.float()).abs().max() < tol


@pytest.mark.parametrize("few", [64, 0])
def test_silu_mul_matches_the_reference(few, monkeypatch):
    """Rows in programs of 256 elements, of 1024 for one row, and (``few`` 0) of a prompt's size."""
    monkeypatch.setattr(fused, "SILU_FEW", few)
    gu = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(3))
    for rows in (gu, gu[:1]):
        assert (K.silu_mul(rows) - OPS.silu_mul(rows)).abs().max() < 1e-6


def test_norms_and_silu_mul_write_the_int8_form_the_decode_kernel_would_make():
    """With ``quantize`` the kernels also attach their output's int8 groups (``out.int8_rows``),
    the same bits as quantizing the output afterwards: what a packed projection reads instead."""
    from neuron.kernels.gpu import quantize_rows

    g = torch.Generator().manual_seed(5)
    x, r, w = (torch.randn(3, 96, generator=g).half(), torch.randn(3, 96, generator=g).half(),
               torch.randn(96, generator=g).half())
    outs = [K.rms_norm(x, w, 1e-6, quantize=True)[0], K.rms_norm(x, w, 1e-6, r.clone(), quantize=True)[0],
            K.silu_mul(torch.randn(2, 2 * 1056, generator=g).half(), quantize=True),  # 1056: a partial block
            K.silu_mul(torch.randn(1, 2 * 1056, generator=g).half(), quantize=True)]
    for out in outs:
        for mine, want in zip(out.int8_rows, quantize_rows(out)):
            assert torch.equal(mine, want)
    assert not hasattr(K.rms_norm(x, w, 1e-6)[0], "int8_rows")


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("uniform", [True, False])
def test_paged_decode_writes_the_int8_form_of_its_output(splits, uniform):
    """Each program quantizes the heads it wrote (whole groups of 32 of the flat row), after the
    split-K merge too: the same bits as quantizing the output afterwards."""
    from neuron.kernels.gpu import int8_rows_buffers, quantize_rows

    g = torch.Generator().manual_seed(11 + splits)
    n_q, n_kv, hd, bs = 4, 2, 64, 16
    kc, vc = (torch.randn(12, bs, n_kv, hd, generator=g).half() for _ in range(2))
    tables = torch.randperm(12, generator=g)[:12].view(3, 4).int()
    q = torch.randn(3, n_q, hd, generator=g).half()
    kv_of_q = torch.arange(n_q) // 2 if uniform else torch.tensor([0, 1, 1, 0])
    args = (q, kc, vc, tables, torch.tensor([2, 0, 1]), torch.tensor([5, 40, 64], dtype=torch.int32),
            kv_of_q.int(), 2 if uniform else 0, hd ** -0.5, splits, torch.zeros(3 * n_q, dtype=torch.int32))
    rows = int8_rows_buffers(3, n_q * hd, q.device)
    out = K.paged_decode(*args, int8_rows=rows)
    assert torch.equal(out, K.paged_decode(*args))
    for mine, want in zip(rows, quantize_rows(out.view(3, n_q * hd))):
        assert torch.equal(mine, want)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("few", [64, 0])
def test_rope_store_rotates_queries_in_place_and_puts_keys_and_values_in_their_cache_rows(norm, store, few,
                                                                                          monkeypatch):
    """A program per token and head, or (``few`` 0) per tile of a prompt's tokens and head."""
    monkeypatch.setattr(fused, "ROPE_FEW", few)
    c = rope_case(norm)
    got = c.qkv.clone()
    if store:
        kc, vc = c.caches()
        K.rope_store(got, c.n_q, c.n_kv, c.pos, c.cos, c.sin, c.qn, c.kn, 1e-6, kc, vc, c.rows)
        c.check(got, kc, vc)
        # or each token's cache row found in the block table from its slot and position
        got = c.qkv.clone()
        kc, vc = c.caches()
        blocks = torch.tensor([[2, 1, 3, 0], [1, 2, 0, 3], [3, 0, 1, 2]], dtype=torch.int32)  # blocks of 4 rows
        slots = torch.tensor([2, 0, 1])  # positions 0, 5, 9: blocks 3, 1, 0 -> rows 12 + 0, 4 + 1, 0 + 1
        K.rope_store(got, c.n_q, c.n_kv, c.pos, c.cos, c.sin, c.qn, c.kn, 1e-6, kc, vc, None, blocks, slots)
        c.rows = torch.tensor([12, 5, 1])
        c.check(got, kc, vc)
    else:
        K.rope_store(got, c.n_q, c.n_kv, c.pos, c.cos, c.sin, c.qn, c.kn, 1e-6)
        assert (got[:, c.n_q: c.n_q + c.n_kv] - c.k).abs().max() < 1e-5
        assert (got[:, :c.n_q] - c.q).abs().max() < 1e-5


@pytest.mark.parametrize("config", K.GEMV_CONFIGS)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_the_skinny_gemm_matches_a_linear_layer(config, m):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 300, generator=g), torch.randn(70, 300, generator=g)  # ragged N and K
    assert (K.gemv(x, w, config) - x @ w.T).abs().max() < 1e-4


def test_greedy_tokens_are_torchs_argmax_and_become_the_sampled_slots_last_draws():
    g = torch.Generator().manual_seed(4)
    V = 3 * K.ARGMAX_CHUNK + 77  # a partial last part
    x = torch.randn(6, V + 3, generator=g)[:, :V]  # rows of a wider buffer, as the graph's logits
    x[1, 100] = x[1, 4000] = 50.0  # a tie: the first index
    x[2] = float("-inf")
    x[3, 777] = x[3, 900] = float("nan")  # NaN wins, the first one
    x[4, V - 1] = float("inf")
    x[5, K.ARGMAX_CHUNK] = 99.0  # the first column of a part
    last = torch.full((8,), -7, dtype=torch.int64)
    slots = torch.tensor([3, 0, 5, 1, 7, 2, 6, 4])
    sampled = torch.tensor([1, 1, 0, 1, 1, 1, 0, 0])  # more rows than logits: the graph's bucket
    tokens = K.greedy_tokens(x, slots, sampled, last)
    want = x.argmax(-1)
    assert tokens.tolist() == want.tolist() == [int(want[0]), 100, 0, 777, V - 1, K.ARGMAX_CHUNK]
    expect = [-7] * 8
    for r in range(6):
        if sampled[r]:
            expect[int(slots[r])] = int(want[r])
    assert last.tolist() == expect


def test_device_tokens_resolve_to_their_slots_last_draws():
    last = torch.tensor([11, 12, 13, 14], dtype=torch.int64)
    ids = torch.tensor([5, -1, 0, -1, 7], dtype=torch.int64)
    slots = torch.tensor([9, 2, 9, 0, 9])  # a slot past ``last`` is never read for a token of its own
    assert K.resolve_tokens(ids, slots, last).tolist() == [5, 13, 0, 11, 7]


def test_packed_rows_by_id_are_the_rows_of_the_dequantized_matrix():
    """The embedding lookup of a packed matrix on a GPU: one launch (kernels/packed.dequantize
    with ids) gives the rows the whole matrix dequantized has."""
    from neuron.kernels import gpu as tk

    g = torch.Generator().manual_seed(2)
    for bits, dt in ((4, torch.float16), (8, torch.float16), (4, torch.float32)):
        N, Kd = 40, 512
        u = torch.randint(0, 256, (N, Kd * bits // 8), dtype=torch.uint8, generator=g)
        per = 2 if dt == torch.float32 else 1  # float32 pairs: the K-quants' groups of 16
        sm = tk.pair_scales(torch.rand(N, Kd // 32 * per, generator=g).to(dt), torch.randn(N, Kd // 32 * per,
                                                                                          generator=g).to(dt))
        ids = torch.tensor([3, 0, 39, 3, 17])
        whole = tk.dequantize(u, sm, bits, torch.float16)
        assert torch.equal(tk.dequantize(u, sm, bits, torch.float16, ids=ids), whole[ids])
        ref = tk.reference_qlinear(torch.eye(Kd), u, sm, bits).t()
        assert (whole.float() - ref).abs().max() < 1e-3 * ref.abs().max()  # float16 rounding


def test_the_runner_gives_prompt_chunks_the_same_logits_through_the_triton_kernels():
    """The runner's Triton wiring (span descriptor, prefill and decode kernels) against its
    SDPA path, on a tiny model: a chunk after a cached prefix that starts mid-block, decodes and
    new prompts in one step, both with two chunks (one SDPA call each) and three (one batched
    call). The runner picks Triton only on CUDA, so here it is switched on by hand."""
    import json
    import tempfile
    from pathlib import Path

    from neuron.loader.model_config import config_from_hf
    from neuron.runner.attention import PagedAttention
    from devtools.checkpoints import make_checkpoint
    from devtools.parity import ParityJob, build
    from protocol import Sampling, StepSeq

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint("llama", Path(tmp), seed=3, head_dim=16, num_attention_heads=4,
                               num_key_value_heads=2)
        job = ParityJob("tiny", "safetensors", [str(p) for p in sorted(Path(ckpt).glob("*.safetensors"))],
                        config_from_hf(json.loads((Path(ckpt) / "config.json").read_text())), prompts=[[0]] * 4)
        plain, _ = build(job)
        fast, _ = build(job)
    fast.triton, fast.sm_count = True, 4
    fast.attention = PagedAttention(fast.kv, fast.tables, fast.model.attention_shape, True, fast.cfg.max_seqs + 1)
    g = torch.Generator().manual_seed(9)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, plain.vocab, (n,), generator=g).tolist()

    greedy = Sampling(temperature=0.0)
    steps = [
        [StepSeq(slot=0, tokens=tokens(37), start_pos=0, sampling=greedy, blocks=[5, 2, 7]),
         StepSeq(slot=1, tokens=tokens(20), start_pos=0, sample=True, sampling=greedy, blocks=[0, 6])],
        [StepSeq(slot=0, tokens=tokens(23), start_pos=37, sample=True, blocks=[1, 4], block_start=3),
         StepSeq(slot=1, tokens=tokens(1), start_pos=20, sample=True),
         StepSeq(slot=2, tokens=tokens(30), start_pos=0, sample=True, sampling=greedy, blocks=[3, 8]),
         StepSeq(slot=3, tokens=tokens(5), start_pos=0, sample=True, sampling=greedy, blocks=[9])],
    ]
    for seqs in steps:
        want = plain.forward_logits(seqs, every_position=True)
        got = fast.forward_logits(seqs, every_position=True)
        assert fast.attention.meta.prefill_spans is not None and not fast.attention.meta.prefills
        assert (got - want).abs().max() < 1e-4
