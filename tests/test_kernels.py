"""The Triton kernels of the GPU fast path against their torch references, run by Triton's
interpreter on the CPU (the same kernels run compiled on the GPU: tests/test_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton")

from neuron.models.ops import TorchOps  # noqa: E402
from neuron.runner import kernels as K  # noqa: E402
from attention_reference import reference_decode, rope_case  # noqa: E402

OPS = TorchOps()


@pytest.mark.parametrize("n_q,n_kv,hd,bs,uniform", [(8, 2, 16, 16, True), (6, 3, 32, 8, True),
                                                    (5, 2, 16, 16, False), (4, 4, 64, 16, True),
                                                    (4, 2, 24, 16, True)])
@pytest.mark.parametrize("splits", [1, 3])
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
        out = K.paged_decode(q, kc, vc, tables, slots, ctx, kv_of_q.int(), repeat, scale, int(ctx.max()), splits,
                             counters)
        assert (out.double() - ref).abs().max() < 1e-5 and not counters.any()


def test_split_count_covers_the_gpu_without_splits_shorter_than_a_tile():
    assert K.decode_splits(1, 8, 4096, 132) == 33
    assert K.decode_splits(1, 8, 100, 132) == 2
    assert K.decode_splits(64, 8, 4096, 132) == 1


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


def test_silu_mul_matches_the_reference():
    gu = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(3))
    assert (K.silu_mul(gu) - OPS.silu_mul(gu)).abs().max() < 1e-6


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("store", [False, True])
def test_rope_store_rotates_queries_in_place_and_puts_keys_and_values_in_their_cache_rows(norm, store):
    c = rope_case(norm)
    got = c.qkv.clone()
    if store:
        kc, vc = c.caches()
        K.rope_store(got, c.n_q, c.n_kv, c.pos, c.cos, c.sin, c.qn, c.kn, 1e-6, kc, vc, c.rows)
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
