"""The kernels of sparse MoE blocks (neuron/kernels/moe.py), which CUDA graphs can hold, against
the per-expert loop of neuron/models/moe.py, run by Triton's interpreter on the CPU: one token and
a decode batch (a program per pair), a prompt's many tokens (the grouped product, both tilings),
and a rank holding only some of the experts on each path; the router's softmax and top-k in one
kernel against torch's."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton")

from neuron.kernels import moe as K  # noqa: E402


def mlp(gate_up, down, x):
    g, u = (gate_up @ x).chunk(2)
    return down @ (torch.nn.functional.silu(g) * u)


def reference(x, weights, chosen, first, gate_up, down, shared=None):
    E, k = gate_up.shape[0], chosen.shape[1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            e = int(chosen[t, j]) - first
            if 0 <= e < E:
                out[t] += weights[t, j] * mlp(gate_up[e], down[e], x[t])
        if shared is not None:
            out[t] += weights[t, k] * mlp(*shared, x[t])
    return out


def silu_mul(h):
    g, u = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


@pytest.mark.parametrize("tokens, experts, k, first, held, shared", [
    (1, 8, 2, 0, 8, 0), (5, 8, 2, 0, 8, 0), (70, 6, 3, 0, 6, 0), (9, 8, 2, 3, 3, 0), (40, 8, 2, 2, 4, 0),
    (100, 8, 3, 2, 4, 0), (1, 8, 2, 0, 8, 32), (3, 8, 2, 2, 4, 24), (2, 8, 2, 0, 8, 0.5), (70, 6, 3, 0, 6, 48)])
def test_the_grouped_experts_equal_the_loop(tokens, experts, k, first, held, shared):
    """``shared``: the width of a shared expert beside them (0.5: an empty share, as a rank
    holding none of its columns), whose weight follows the chosen ones'."""
    assert (tokens * k <= K.PAIRS_ALONE) == (tokens < 50) and (tokens * k > 256) == (tokens == 100)
    g = torch.Generator().manual_seed(tokens * 10 + first)
    H, inter = 64, 32
    x = torch.randn(tokens, H, generator=g)
    probs = torch.rand(tokens, experts, generator=g)
    weights, chosen = torch.topk(probs, k, dim=-1)
    gate_up = torch.randn(held, 2 * inter, H, generator=g) * 0.1
    down = torch.randn(held, H, inter, generator=g) * 0.1
    pair = None
    if shared:
        width = int(shared)
        pair = (torch.randn(2 * width, H, generator=g) * 0.1, torch.randn(H, width, generator=g) * 0.1)
        weights = torch.cat([weights, torch.rand(tokens, 1, generator=g)], 1)
    got = K.sparse_moe(x, weights, chosen, first, gate_up, down, silu_mul, pair)
    want = reference(x, weights, chosen, first, gate_up, down, pair)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("tokens", [2, 70])
def test_a_shared_gate_column_is_ignored_without_its_expert(tokens):
    """The router writes the shared expert's gate after the chosen weights even where that expert
    runs outside the kernels (packed, or with a bias): both paths then read only the first k."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g)
    weights, chosen = torch.topk(torch.rand(tokens, 8, generator=g), 3, dim=-1)
    gate_up, down = torch.randn(8, 64, 64, generator=g) * 0.1, torch.randn(8, 64, 32, generator=g) * 0.1
    gated = torch.cat([weights, torch.full((tokens, 1), 100.0)], 1)
    got = K.sparse_moe(x, gated, chosen, 0, gate_up, down, silu_mul)
    want = reference(x, weights, chosen, 0, gate_up, down)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_pairs_are_sorted_by_expert_into_padded_blocks():
    chosen = torch.tensor([[2, 0], [2, 1], [0, 2]])
    pairs, block_expert = K.sort_pairs(chosen, 4, 2)
    # pairs (token, choice) 0..5 go to experts 2 0 2 1 0 2: expert 0 takes pairs 1, 4; expert 1 pair 3
    # (+ padding: 6, the pair count); expert 2 pairs 0, 2, 5 (+ padding); expert 3 none
    assert pairs.tolist()[:8] == [1, 4, 3, 6, 0, 2, 5, 6]
    assert block_expert.tolist()[:4] == [0, 1, 2, 2] and all(e == -1 for e in block_expert.tolist()[4:])


@pytest.mark.parametrize("tokens, experts, k, norm, dtype, shared", [(1, 8, 2, True, torch.float32, False),
                                                                      (5, 60, 4, False, torch.float32, True),
                                                                      (3, 256, 8, True, torch.bfloat16, True),
                                                                      (64, 128, 8, False, torch.bfloat16, False),
                                                                      (2, 512, 10, True, torch.float32, False)])
def test_the_router_kernel_equals_softmax_and_topk(tokens, experts, k, norm, dtype, shared):
    """``shared``: the logits hold a shared expert's gate after the experts' (its sigmoid follows
    the chosen experts' weights)."""
    g = torch.Generator().manual_seed(tokens * 7 + experts)
    logits = (torch.randn(tokens, experts + shared, generator=g) * 3).to(dtype)
    if shared:
        gate = torch.sigmoid(logits[:, experts:].float())
        logits_all, logits = logits, logits[:, :experts]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    want_w, _ = torch.topk(probs, k, dim=-1)
    if norm:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    weights, chosen = K.route(logits_all if shared else logits, k, norm, dtype, experts)
    assert weights.dtype == dtype and chosen.dtype == torch.int64 and weights.shape == (tokens, k + shared)
    if shared:
        rtol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(weights[:, k:].float(), gate.to(dtype).float(), rtol=rtol)
        weights = weights[:, :k]
    assert all(len(set(row)) == k for row in chosen.tolist())
    # the k largest, largest first (of equal logits, which bfloat16 has, either may come first)
    assert torch.equal(probs.gather(1, chosen), torch.topk(probs, k, dim=-1).values)
    assert torch.allclose(weights.float(), want_w.to(dtype).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def packed_experts(g, experts, rows, K, bits, per):
    """Random experts' W [E, rows, K] packed (scales per 32 columns, or per 32 * ``per``) and the
    float32 W they stand for (unpacked here with torch, not with the kernels' own code)."""
    from neuron.kernels.moe_packed import PackedExperts
    from neuron.kernels.packed_scales import coarsen_scales, pair_scales
    from neuron.models.packed_linear import unpack_nibbles

    us, sms, ws = [], [], []
    for _ in range(experts):
        u = torch.randint(0, 256, (rows, K * bits // 8), generator=g, dtype=torch.uint8)
        s = (torch.rand(rows, K // 32 // per, generator=g) * 0.02).half().float()
        m = -s * torch.randint(0, 2 ** bits, s.shape, generator=g).float() / 2
        s, m = s.repeat_interleave(per, 1).half(), m.repeat_interleave(per, 1).half()
        q = unpack_nibbles(u) if bits == 4 else u
        ws.append((q.float().view(rows, K // 32, 32) * s.float()[..., None] + m.float()[..., None]).view(rows, K))
        us.append(u)
        sms.append(coarsen_scales(pair_scales(s, m)))
    return PackedExperts(torch.stack(us), torch.stack(sms), bits), torch.stack(ws)


@pytest.mark.parametrize("tokens, k, first, held, bits, per, shared", [
    (1, 2, 0, 8, 4, 1, 0), (5, 2, 3, 3, 8, 1, 16), (3, 2, 0, 8, 4, 4, 0), (70, 3, 2, 4, 4, 1, 0),
    (100, 3, 0, 8, 8, 4, 32)])
def test_packed_experts_equal_the_loop_over_their_float_weights(tokens, k, first, held, bits, per, shared):
    """Experts of packed groups (``moe_packed``), 4 and 8 bits, scales per 32 or 128 columns, a
    rank holding some of them, a dense shared expert beside them: a decode batch (a program per
    pair) and a prompt (the grouped product) against the loop over the weights they unpack to."""
    from neuron.kernels.moe_packed import PackedExperts

    g = torch.Generator().manual_seed(tokens * 10 + bits + per)
    H = inter = 32 * max(per, 2)
    x = torch.randn(tokens, H, generator=g)
    weights, chosen = torch.topk(torch.rand(tokens, 8, generator=g), k, dim=-1)
    gate_up, gate_up_w = packed_experts(g, held, 2 * inter, H, bits, per)
    down, down_w = packed_experts(g, held, H, inter, bits, per)
    assert isinstance(gate_up, PackedExperts) and gate_up.shape == (held, 2 * inter, H)
    pair = None
    if shared:
        pair = (torch.randn(2 * shared, H, generator=g) * 0.1, torch.randn(H, shared, generator=g) * 0.1)
        weights = torch.cat([weights, torch.rand(tokens, 1, generator=g)], 1)
    got = K.sparse_moe(x, weights, chosen, first, gate_up, down, silu_mul, pair)
    want = reference(x, weights, chosen, first, gate_up_w, down_w, pair)
    assert torch.allclose(got, want, atol=1e-4 * want.abs().max()), (got - want).abs().max()
