"""Prefix caching through a real server (CPU, the default model): outputs are the same with the
cache on and off, ``cached_tokens`` is exact, a reloaded model starts with an empty cache, and
TP=2 gives what TP=1 gives."""

from __future__ import annotations

import httpx
import pytest

from conftest import DEFAULT_MODEL, start_server

BLOCK = 16
SYSTEM = ("You are a careful assistant for a small hardware shop. Answer in one short sentence, "
          "name the aisle when you can, and never invent a product the shop does not sell. ") * 3


def config(caching: bool, tp: int = 1) -> str:
    return (f'[[models]]\nmodel = "{DEFAULT_MODEL}"\nmax_model_len = 1024\nmax_slots = 4\nblock_size = {BLOCK}\n'
            f'prefix_caching = {str(caching).lower()}\ntensor_parallel = {tp}\n')


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix")
    on, off = start_server(tmp, config=config(True)), start_server(tmp, config=config(False))
    yield on, off
    on.stop()
    off.stop()


def chat(server, messages: list[dict], **extra) -> dict:
    r = httpx.post(f"{server.base}/chat/completions", timeout=300, json={
        "model": DEFAULT_MODEL, "messages": messages, "temperature": 0, "max_tokens": 24, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def prompt_ids(server, messages: list[dict]) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", timeout=60, json={"model": DEFAULT_MODEL, "messages": messages,
                                                                "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def expected_hit(earlier: list[list[int]], prompt: list[int]) -> int:
    """Whole blocks of the longest prefix ``prompt`` shares with an earlier prompt or answer,
    short of its last token."""
    best = 0
    for seen in earlier:
        n = 0
        while n < min(len(seen), len(prompt)) and seen[n] == prompt[n]:
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1) // BLOCK * BLOCK


def test_a_multi_turn_chat_is_the_same_with_the_cache_and_takes_earlier_turns_from_it(servers):
    on, off = servers
    questions = ["Do you sell hammers?", "And nails for them?", "Which aisle is that?", "Thanks, anything else?"]
    history_on: list[dict] = [{"role": "system", "content": SYSTEM}]
    history_off = list(history_on)
    seen: list[list[int]] = []
    for q in questions:
        history_on.append({"role": "user", "content": q})
        history_off.append({"role": "user", "content": q})
        ids = prompt_ids(on, history_on)
        a, b = chat(on, history_on, return_token_ids=True), chat(off, history_off)
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hit(seen, ids)
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # every position whose K/V was computed: the prompt and the answer but its last token
        seen.append((ids + a["choices"][0]["token_ids"])[:-1])
        history_on.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
        history_off.append({"role": "assistant", "content": b["choices"][0]["message"]["content"]})
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] > 100


def test_requests_sharing_a_system_prompt_get_the_same_answers_and_seeds_and_penalties_hold(servers):
    on, off = servers
    extras = [{}, {"repetition_penalty": 1.3, "frequency_penalty": 0.5}, {"temperature": 0.8, "seed": 11},
              {"presence_penalty": 1.0, "top_k": 5, "temperature": 0.7, "seed": 3}]
    for i, extra in enumerate(extras):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: glue?"}]
        a, b = chat(on, messages, **extra), chat(off, messages, **extra)
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"], extra
        if i:
            assert a["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(SYSTEM) // 8 // BLOCK * BLOCK
    info = httpx.get(f"{on.url}/models", timeout=10).json()["models"][0]
    assert info["prefix_cache_hits"] > 0 and info["prefix_cache_queries"] > info["prefix_cache_hits"]


def test_an_unloaded_and_reloaded_model_starts_with_an_empty_cache(servers):
    on, _ = servers
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Saws?"}]
    chat(on, messages)
    assert chat(on, messages)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert httpx.post(f"{on.url}/models/unload", json={"model": DEFAULT_MODEL}, timeout=120).status_code == 200
    r = httpx.post(f"{on.url}/models/load", json={"model": DEFAULT_MODEL, "max_model_len": 1024, "max_slots": 4},
                   timeout=300)
    assert r.status_code == 200, r.text
    assert chat(on, messages)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert chat(on, messages)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_tp2_gives_what_tp1_gives_with_the_cache(servers, tmp_path):
    on, _ = servers
    tp2 = start_server(tmp_path, config=config(True, tp=2))
    try:
        for q in ("Paint brushes?", "Paint rollers?"):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            a, b = chat(on, messages), chat(tp2, messages)
            assert a["choices"][0]["message"] == b["choices"][0]["message"]
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        assert tp2.stop() == 0
