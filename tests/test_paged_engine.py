"""The paged KV cache and overlapped steps through a real server (CPU, the default model):
preemption and recompute, stops and aborts with a step in flight, and batching that does not
change what a request gets."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import DEFAULT_MODEL, json_log, start_server

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "List three colours:", "def fibonacci(n):", "Water boils at", "The quick brown fox",
           "In 1969, the first humans", "My favourite food is", "Photosynthesis is the process by which plants",
           "Q: What is two plus two?\nA:", "Dear team, I am writing to let you know that",
           "The three laws of motion are", "Once, a cat", "Machine learning", "Paris is known for its",
           "Here is a short poem about the moon:\n"]
LENGTHS = [24, 7, 16, 31, 5, 19, 28, 11, 22, 9, 26, 14, 30, 6, 17, 21]


def completion(server, prompt: str, max_tokens: int, **extra) -> dict:
    r = httpx.post(f"{server.base}/completions", timeout=300, json={
        "model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def together(server, jobs: list[tuple[str, int]], **extra) -> list[dict]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: completion(server, *job, **extra), jobs))


def model_info(server) -> dict:
    return httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Sixteen slots: every request of a batch runs at once."""
    config = (f'[[models]]\nmodel = "{DEFAULT_MODEL}"\nmax_model_len = 512\nmax_slots = 16\n'
              f'[engine]\nmax_queue_wait_s = 600\n')
    server = start_server(tmp_path_factory.mktemp("wide"), config=config)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    """Room for about two and a half of the requests below at once: the rest wait, and running
    ones get preempted."""
    config = (f'[server]\nlog_format = "json"\n\n[[models]]\nmodel = "{DEFAULT_MODEL}"\nmax_model_len = 192\n'
              f'max_slots = 6\nkv_cache_tokens = 192\nblock_size = 16\n[engine]\nmax_queue_wait_s = 600\n')
    server = start_server(tmp_path_factory.mktemp("small-cache"), config=config)
    yield server
    server.stop()


def test_sixteen_concurrent_requests_of_different_lengths_get_what_each_gets_alone(wide):
    jobs = list(zip(PROMPTS, LENGTHS))
    alone = [completion(wide, *job)["choices"][0]["token_ids"] for job in jobs]
    both = [r["choices"][0]["token_ids"] for r in together(wide, jobs)]
    assert both == alone
    assert all(0 < len(t) <= n for t, n in zip(alone, LENGTHS))


@pytest.mark.timeout(900)
def test_requests_wait_for_blocks_and_preempted_ones_are_recomputed_to_the_same_tokens(small_cache):
    jobs = [(p, 72) for p in PROMPTS[:6]]  # 5 blocks each at the end: any 3 at once overrun the 12
    alone = [completion(small_cache, *job, ignore_eos=True)["choices"][0]["token_ids"] for job in jobs]
    before = model_info(small_cache)["preemptions"]
    results = together(small_cache, jobs, ignore_eos=True)
    info = model_info(small_cache)
    assert [r["choices"][0]["token_ids"] for r in results] == alone
    assert all(r["usage"]["completion_tokens"] == 72 for r in results)
    assert info["preemptions"] > before, "the cache was meant to run out"
    assert info["kv_usage"] == 0 and info["running"] == 0 and info["waiting"] == 0
    lines = [r for r in json_log(small_cache) if r.get("msg") == "request finished"]
    assert sum(r["preemptions"] for r in lines) == info["preemptions"]  # each request's line counts its own


def test_a_stop_with_the_next_step_in_flight_emits_nothing_after_it(wide):
    from neuron.loader.spec import load_spec

    tokenizer = load_spec(DEFAULT_MODEL).tokenizer.tokenizer
    prompt = "The capital of France is"
    full = completion(wide, prompt, 24, ignore_eos=True)["choices"][0]
    ids = full["token_ids"]
    # The first token from the 4th on whose text is new: a stop string made of it ends the answer there.
    k = next(i for i in range(3, len(ids)) if (piece := tokenizer.decode([ids[i]]).strip())
             and piece not in tokenizer.decode(ids[:i]))
    stop = tokenizer.decode([ids[k]]).strip()
    shown = tokenizer.decode(ids[:k])
    for stream in (False, True):
        body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stop": [stop], "return_token_ids": True, "stream": stream}
        got_ids, text = [], ""
        if stream:
            with httpx.stream("POST", f"{wide.base}/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        got_ids += choice.get("token_ids") or []
                        text += choice.get("text") or ""
        else:
            choice = httpx.post(f"{wide.base}/completions", json=body, timeout=120).json()["choices"][0]
            got_ids, text = choice["token_ids"], choice["text"]
            assert choice["finish_reason"] == "stop"
        assert got_ids == ids[: k + 1]  # up to the token that completed the stop, and not one more
        assert stop not in text and text.rstrip() == shown.rstrip()
    assert model_info(wide)["kv_usage"] == 0


def test_max_tokens_ends_the_stream_exactly_even_with_steps_in_flight(wide):
    for n in (1, 2, 3, 17):
        out = completion(wide, "Once upon a time", n, ignore_eos=True)
        assert out["usage"]["completion_tokens"] == n and len(out["choices"][0]["token_ids"]) == n


def test_an_abort_mid_stream_frees_every_block(small_cache):
    body = {"model": DEFAULT_MODEL, "prompt": PROMPTS[1], "max_tokens": 150, "temperature": 0, "ignore_eos": True,
            "stream": True}
    for _ in range(3):
        with httpx.stream("POST", f"{small_cache.base}/completions", json=body, timeout=120) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen == 10:
                    break  # the client goes away with steps in flight
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = model_info(small_cache)
        if info["running"] == 0 and info["kv_usage"] == 0:
            break
        time.sleep(0.2)
    assert info["running"] == 0 and info["waiting"] == 0 and info["kv_usage"] == 0
    # and the cache is whole: a request that needs all of it runs
    assert completion(small_cache, PROMPTS[0], 150, ignore_eos=True)["usage"]["completion_tokens"] == 150
