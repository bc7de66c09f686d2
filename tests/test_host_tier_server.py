"""The prefix cache's host tier through a real server (CPU, the default model): a
rank cache too small for three long prompts evicts the first one's blocks into the host tier
(TP=2: each rank its share of the heads; PP=2: each stage its layers),
and that prompt coming back is restored from there and answers exactly as it did cold; `GET
/models`, `/metrics` and the request's log line count it by tier."""

from __future__ import annotations

import httpx
import pytest

from conftest import DEFAULT_MODEL, json_log, start_server
from neuron.prefix_tiers import leave_s

TOPICS = ["garden tools and the care of their wooden handles", "the history of the bicycle in northern towns",
          "how a small bakery plans its week of bread", "knots a sailor learns first and why"]


def long_prompt(topic: str) -> str:
    return " ".join(f"Sentence {i} of a long note on {topic}, kept for the record." for i in range(16))


def config(tp: int, pp: int = 1) -> str:
    # 64 blocks of 16 in the rank's cache: three long prompts do not fit together
    return (f'[server]\nlog_format = "json"\n\n[cache]\nhost_gb = 0.12\n\n[[models]]\nmodel = "{DEFAULT_MODEL}"\nmax_model_len = 768\n'
            f'kv_cache_tokens = 1024\nmax_slots = 2\ntensor_parallel = {tp}\npipeline_parallel = {pp}\n')


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("host-tier")
    servers = [start_server(tmp, config=config(1)), start_server(tmp, config=config(2)),
               start_server(tmp, config=config(1, pp=2))]
    yield servers
    for server in servers:
        server.stop()


def ask(server, topic: str) -> dict:
    r = httpx.post(f"{server.base}/chat/completions", timeout=300, json={
        "model": DEFAULT_MODEL, "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": long_prompt(topic)}], "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("which", [0, 1, 2], ids=["tp1", "tp2", "pp2"])
def test_an_evicted_prompt_comes_back_from_the_host_tier_with_its_cold_answer(servers, which):
    server = servers[which]
    cold = [ask(server, t) for t in TOPICS]  # the first prompts' blocks leave the rank's cache
    info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
    tier = info["prefix_cache_tiers"]["host"]
    assert tier["offloaded"] > 0 and tier["blocks"] >= 100 and len(tier["bytes"]) == (1 if which == 0 else 2)
    again = ask(server, TOPICS[0])
    assert again["choices"][0]["token_ids"] == cold[0]["choices"][0]["token_ids"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= again["usage"]["prompt_tokens"] - 16 - 15
    after = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]["prefix_cache_tiers"]["host"]
    assert after["hits"] - tier["hits"] > 0 and after["restored"] > tier["restored"]
    assert tier["offload_seconds"] > 0 and after["restore_seconds"] > tier["restore_seconds"]
    lines = [r for r in json_log(server) if r.get("msg") == "request finished"]
    assert lines[-1]["cached_tokens"] == cached and 0 < lines[-1]["cached_host_tokens"] <= cached
    assert lines[-1]["cached_disk_tokens"] == 0
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'neuron:prefix_cache_tier_hits_total{model_name="%s",tier="host"}' % DEFAULT_MODEL in metrics
    assert 'neuron:prefix_cache_tier_blocks_moved_total{direction="restore",model_name="%s"}' % DEFAULT_MODEL \
        in metrics or 'neuron:prefix_cache_tier_blocks_moved_total{model_name="%s",direction="restore"}' \
        % DEFAULT_MODEL in metrics
    gauge = [line for line in metrics.splitlines() if line.startswith("neuron:prefix_cache_tier_bandwidth_bytes_per_second")
             and 'direction="restore"' in line]
    assert len(gauge) == 1 and float(gauge[0].split()[-1]) > 0


def test_tp2_pp2_and_tp1_answer_alike_through_the_tier(servers):
    for topic in (TOPICS[1], TOPICS[2]):
        answers = [ask(server, topic)["choices"][0]["token_ids"] for server in servers]
        assert answers[0] == answers[1] == answers[2]


def test_ranks_with_a_large_host_tier_get_the_time_to_give_it_back():
    """Unlocking and unmapping a host tier of tens of GB takes seconds, before a rank says bye: a
    shutdown or an unload waits for it beyond its usual limit rather than call the rank unclean."""
    assert leave_s([], 5.0) == 5.0
    assert leave_s([40 * 10**9, 40 * 10**9], 5.0) >= 5.0 + 9.0
