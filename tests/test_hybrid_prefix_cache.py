"""The prefix cache of a hybrid model (Gated DeltaNet layers keep a recurrent state that cached
K/V cannot rebuild), through real servers on a small random Qwen3.5 checkpoint, the cache on and
off side by side: a repeated prompt restarts at its last full block, each turn of a chat restarts
at the very end of the turn before it (its answer included), a long shared system prompt followed
by different questions restarts at its last snapshot, and every answer is the one the server
without the cache gives. The snapshots stay within their slots (those reserved for them, and
those running sequences leave free)."""

from __future__ import annotations

import random

import httpx
import pytest

from conftest import start_server

BLOCK, INTERVAL, SNAPSHOTS = 16, 64, 12


def config(ckpt, caching: bool, tp: int = 1) -> str:
    return (f'[[models]]\nmodel = "{ckpt}"\nid = "hybrid"\ndtype = "float32"\nmax_model_len = 512\nmax_slots = 4\n'
            f'block_size = {BLOCK}\nprefix_caching = {str(caching).lower()}\nstate_snapshots = {SNAPSHOTS}\n'
            f'state_snapshot_interval = {INTERVAL}\ntensor_parallel = {tp}\ngpu_memory_utilization = 0.3\n'
            '[engine]\nprefill_chunk = 48\n'  # two servers share a GPU where one is
            + ('[cache]\nhost_gb = 0.00005\n' if caching else ''))  # too small a tier: see the last test


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from test_hybrid import built

    _, ckpt, _ = built("qwen3_5_text", tmp_path_factory)
    tmp = tmp_path_factory.mktemp("hybrid-prefix")
    on, off = start_server(tmp, config=config(ckpt, True)), start_server(tmp, config=config(ckpt, False))
    yield on, off, ckpt
    on.stop()
    off.stop()


def complete(server, prompt: list[int], tokens: int = 12, logprobs: bool = False):
    """The greedy continuation and the cached prompt tokens (and with ``logprobs``, each token's)."""
    r = httpx.post(f"{server.base}/completions", timeout=120, json={
        "model": "hybrid", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **({"logprobs": 1} if logprobs else {})})
    assert r.status_code == 200, r.text
    body = r.json()
    choice, cached = body["choices"][0], body["usage"]["prompt_tokens_details"]["cached_tokens"]
    if logprobs:
        return choice["token_ids"], cached, choice["logprobs"]["token_logprobs"]
    return choice["token_ids"], cached


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


def models(server) -> dict:
    return httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]


def test_a_repeated_prompt_restarts_at_its_last_full_block(servers):
    on, off, _ = servers
    prompt = words(random.Random(1), 100)
    first, cached = complete(on, prompt)
    assert cached == 0 and first == complete(off, prompt)[0]
    again, cached = complete(on, prompt)
    assert again == first and cached >= 96  # 6 blocks of 16: all but the last token's partial block
    info = models(on)
    assert info["prefix_caching"] and info["state_snapshots"] == SNAPSHOTS and info["state_restores"] >= 1


def test_each_turn_of_a_chat_restarts_at_the_end_of_the_turn_before(servers):
    """Four turns, each prompt the last one with its answer and a new question (token ids, so the
    answer is exactly what was generated): at least the last prompt and answer less one block come
    from the cache, the answers are those of the server without the cache."""
    on, off, _ = servers
    rng = random.Random(2)
    history = words(rng, 30)
    for turn in range(4):
        answer, cached = complete(on, history, tokens=10 + 7 * turn)
        assert answer == complete(off, history, tokens=10 + 7 * turn)[0]
        if turn:
            assert cached >= previous - BLOCK, (turn, cached, previous)
        previous = len(history) + len(answer)
        history = history + answer + words(rng, 5 + 9 * turn)


def test_a_chat_through_the_chat_api_takes_what_its_turns_share_from_the_cache(servers):
    """The same through /v1/chat/completions (the chat template renders each turn): every turn
    after the first takes at least the part of its prompt it shares with the turn before (as the
    model's own tokens of that turn's answer re-tokenize) less one block."""
    on, off, _ = servers
    messages = [{"role": "system", "content": "You answer in few words."}]
    seen: list[int] = []
    for question in ("What is the lighthouse for?", "And the market?", "When does it open?", "Thanks."):
        messages.append({"role": "user", "content": question})
        ids = httpx.post(f"{on.url}/tokenize", timeout=30, json={
            "model": "hybrid", "messages": messages, "add_generation_prompt": True}).json()["tokens"]
        answers = []
        for server in (on, off):
            r = httpx.post(f"{server.base}/chat/completions", timeout=120, json={
                "model": "hybrid", "messages": messages, "temperature": 0, "max_tokens": 12,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            answers.append(r.json())
        assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
        shared = next((i for i, (a, b) in enumerate(zip(seen, ids)) if a != b), min(len(seen), len(ids)))
        assert answers[0]["usage"]["prompt_tokens_details"]["cached_tokens"] >= min(shared, len(ids) - 1) - BLOCK
        seen = ids + answers[0]["choices"][0]["token_ids"]
        messages.append({"role": "assistant", "content": answers[0]["choices"][0]["message"]["content"]})


def test_questions_after_a_long_shared_system_prompt_restart_at_its_last_snapshot(servers):
    on, off, _ = servers
    rng = random.Random(3)
    system = words(rng, 300)
    for i in range(3):
        prompt = system + words(rng, 20)
        answer, cached, logprobs = complete(on, prompt, logprobs=True)
        want, _, want_logprobs = complete(off, prompt, logprobs=True)
        assert answer == want and max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4
        if i:
            assert cached >= 300 // INTERVAL * INTERVAL
    info = models(on)  # snapshots take the slots running sequences leave free: all of them now
    assert info["state_snapshots_used"] <= info["state_slots"] == SNAPSHOTS + 4 and info["state_slots_used"] == 0


def test_snapshots_stay_within_their_budget_and_evicted_ones_are_recomputed(servers):
    """More prompts than snapshot slots: the oldest go, a prompt whose snapshot went is computed
    again, with the same answer."""
    on, off, _ = servers
    rng = random.Random(4)
    prompts = [words(rng, 70) for _ in range(2 * SNAPSHOTS)]
    answers = [complete(on, p)[0] for p in prompts]
    assert models(on)["state_snapshots_used"] <= SNAPSHOTS + 4
    again, cached = complete(on, prompts[0])
    assert again == answers[0] == complete(off, prompts[0])[0]
    assert cached == 0


def test_a_host_tier_too_small_for_two_state_snapshots_is_refused_by_name(servers):
    """A hybrid model's cached prefixes need its state snapshots as well as its blocks: a host tier
    that cannot hold two of them is none, the load says so, and the model shows no tier."""
    on, _, _ = servers
    assert models(on)["prefix_cache_tiers"] == {}
    assert "no host tier (cache.host_gb 5e-05): less than two of its state snapshots" in on.log()
