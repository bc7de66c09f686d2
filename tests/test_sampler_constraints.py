"""The rank's sampler honours structured-output masks, min_tokens and logit_bias."""

from __future__ import annotations

import torch

from neuron.rank.sampler import Sampler, unpack_mask
from protocol import Sampling

V = 70


def mask_of(allowed: set[int]) -> bytes:
    words = [0] * ((V + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_a_mask_unpacks_to_exactly_the_allowed_tokens():
    allowed = {0, 5, 31, 32, 63, 64, 69}
    bits = unpack_mask(mask_of(allowed), V, torch.device("cpu"))
    assert set(torch.nonzero(bits).flatten().tolist()) == allowed


def test_a_mask_limits_greedy_and_random_draws_to_the_allowed_tokens():
    logits = torch.randn(2, V)
    logits[:, 3] = 50.0  # the favourite, not allowed
    sampler = Sampler(torch.device("cpu"))
    allowed = {7, 11, 40}
    for slot, temperature in ((0, 0.0), (1, 1.0)):
        sampler.feed(slot, 0, [1, 2])
    for _ in range(20):
        tokens, _ = sampler.sample(logits, [0, 1], [Sampling(temperature=0.0), Sampling(temperature=1.0)],
                                   [mask_of(allowed), mask_of(allowed)])
        assert set(tokens) <= allowed
    assert tokens[0] == max(allowed, key=lambda t: float(logits[0, t]))


def test_min_tokens_keeps_the_stop_tokens_out_until_enough_are_generated():
    logits = torch.zeros(1, V)
    logits[0, 9] = 10.0  # the stop token is the favourite
    sampler = Sampler(torch.device("cpu"))
    p = Sampling(temperature=0.0, prompt_len=2, min_tokens=2, stop_token_ids=[9])
    sampler.feed(0, 0, [1, 2])  # nothing generated yet
    assert sampler.sample(logits, [0], [p])[0] != [9]
    sampler.feed(0, 2, [4])  # one generated
    assert sampler.sample(logits, [0], [p])[0] != [9]
    sampler.feed(0, 3, [4])  # two generated: the stop token may come now
    assert sampler.sample(logits, [0], [p])[0] == [9]


def test_logit_bias_moves_the_greedy_choice():
    logits = torch.zeros(1, V)
    logits[0, 1] = 1.0
    sampler = Sampler(torch.device("cpu"))
    sampler.feed(0, 0, [1])
    assert sampler.sample(logits, [0], [Sampling(temperature=0.0)])[0] == [1]
    assert sampler.sample(logits, [0], [Sampling(temperature=0.0, logit_bias=[(33, 5.0)])])[0] == [33]
    assert sampler.sample(logits, [0], [Sampling(temperature=0.0, logit_bias=[(1, -100.0)])])[0] != [1]
