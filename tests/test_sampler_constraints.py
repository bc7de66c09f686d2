"""The rank's device sampler honours structured-output masks, min_tokens and logit_bias."""

from __future__ import annotations

import torch

from neuron.runner.sampler import DeviceSampler, unpack_mask
from protocol import Sampling

V = 70
CPU = torch.device("cpu")


def mask_of(allowed: set[int]) -> bytes:
    words = [0] * ((V + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def draw(sampler: DeviceSampler, logits: torch.Tensor, slots: list[int], positions: list[int],
         masks: list[bytes | None] | None = None) -> list[int]:
    tokens, _ = sampler.sample(logits, slots, torch.tensor(slots), positions, masks or [None] * len(slots))
    return tokens.tolist()


def test_a_mask_unpacks_to_exactly_the_allowed_tokens():
    allowed = {0, 5, 31, 32, 63, 64, 69}
    bits = unpack_mask(mask_of(allowed), V, CPU)
    assert set(torch.nonzero(bits).flatten().tolist()) == allowed


def test_a_mask_limits_greedy_and_random_draws_to_the_allowed_tokens():
    logits = torch.randn(2, V)
    logits[:, 3] = 50.0  # the favourite, not allowed
    sampler = DeviceSampler(4, V, CPU)
    sampler.start(0, Sampling(temperature=0.0, prompt_len=2))
    sampler.start(1, Sampling(temperature=1.0, prompt_len=2))
    allowed = {7, 11, 40}
    for i in range(20):
        tokens = draw(sampler, logits, [0, 1], [1 + i, 1 + i], [mask_of(allowed), mask_of(allowed)])
        assert set(tokens) <= allowed
    assert tokens[0] == max(allowed, key=lambda t: float(logits[0, t]))


def test_min_tokens_keeps_the_stop_tokens_out_until_enough_are_generated():
    logits = torch.zeros(1, V)
    logits[0, 9] = 10.0  # the stop token is the favourite
    sampler = DeviceSampler(2, V, CPU)
    sampler.start(0, Sampling(temperature=0.0, prompt_len=2, min_tokens=2, stop_token_ids=[9]))
    assert draw(sampler, logits, [0], [1]) != [9]  # the first generated token
    assert draw(sampler, logits, [0], [2]) != [9]  # the second
    assert draw(sampler, logits, [0], [3]) == [9]  # two are out: the stop token may come now


def test_logit_bias_moves_the_greedy_choice():
    logits = torch.zeros(1, V)
    logits[0, 1] = 1.0
    sampler = DeviceSampler(2, V, CPU)
    sampler.start(0, Sampling(temperature=0.0))
    assert draw(sampler, logits, [0], [0]) == [1]
    sampler.start(0, Sampling(temperature=0.0, logit_bias=[(33, 5.0)]))
    assert draw(sampler, logits, [0], [0]) == [33]
    sampler.start(0, Sampling(temperature=0.0, logit_bias=[(1, -100.0)]))
    assert draw(sampler, logits, [0], [0]) != [1]


def test_a_decode_graphs_argmax_is_the_greedy_draw_unless_the_logits_are_changed_or_sampled():
    """The decode graph stores each row's argmax as its slot's last draw (kernels/sampling.py
    greedy_tokens); the sampler takes those tokens as they are for plain greedy rows, and draws
    (and stores) its own where a bias, a mask or a temperature changes the choice."""
    logits = torch.zeros(2, V)
    logits[:, 4] = 3.0
    logits[:, 6] = 2.0
    sampler = DeviceSampler(4, V, CPU)
    for slot in (0, 1):
        sampler.start(slot, Sampling(temperature=0.0))
    sampler.last_token[:] = -1
    argmax = torch.tensor([4, 4])
    tokens, _ = sampler.sample(logits, [0, 1], torch.tensor([0, 1]), [5, 5], [None, None], argmax)
    assert tokens is argmax and sampler.last_token.tolist() == [-1, -1, -1, -1]  # the graph stored them
    sampler.start(1, Sampling(temperature=0.0, logit_bias=[(6, 5.0)]))
    tokens, _ = sampler.sample(logits, [0, 1], torch.tensor([0, 1]), [6, 6], [None, None], argmax)
    assert tokens.tolist() == [4, 6] and sampler.last_token.tolist() == [4, 6, -1, -1]
    sampler.start(1, Sampling(temperature=1.0, seed=3))
    sampler.last_token[:] = -1
    tokens, _ = sampler.sample(logits, [0, 1], torch.tensor([0, 1]), [7, 7], [mask_of({30}), None], argmax)
    assert tokens[0] == 30 and sampler.last_token[:2].tolist() == tokens.tolist()


def test_a_thinking_budget_forces_the_end_marker_once_spent():
    from neuron.server.grammar.constraints import ThinkingBudget

    words = {1: b"<think>", 2: b"a", 3: b"b", 4: b"</", 5: b"think>", 6: b"ok", 7: b"\xff</think>", 8: b" "}

    def run(budget: int, thinking: bool | None, tokens: list[int]) -> list[tuple[int, bytes | None]]:
        c = ThinkingBudget(budget, b"<think>", b"</think>", [4, 5], V, words.__getitem__, thinking)
        seen = []
        for t in tokens:
            seen.append((t, c.allowed()))
            c.accept(t)
        return seen + [(-1, c.allowed())]

    forced = {t: mask_of({t}) for t in (4, 5)}
    # Opened by the prompt: two tokens of thinking, then "</" and "think>" forced, then free.
    assert run(2, True, [2, 3, 4, 5, 6]) == [(2, None), (3, None), (4, forced[4]), (5, forced[5]), (6, None),
                                             (-1, None)]
    # Opened by the output (after a space): its budget counts from there.
    assert [m for _, m in run(1, None, [8, 1, 2, 4, 5])] == [None, None, None, forced[4], forced[5], None]
    # The model closes its thinking itself (a special token too): nothing is forced.
    assert all(m is None for _, m in run(3, True, [2, 7, 2, 2, 2]))
    assert all(m is None for _, m in run(2, None, [2, 3, 3, 3]))  # it answered without thinking
    assert all(m is None for _, m in run(0, False, [2, 3]))  # the template closed the thinking
    assert run(0, True, [4, 5, 6])[0][1] == forced[4]  # a budget of 0: no thinking at all
