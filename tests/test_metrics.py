"""/metrics parses with the Prometheus text parser, carries vLLM's names under ``neuron:``, and
its counters and histograms move by exactly what known requests did."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import DEFAULT_MODEL

MODEL = {"model_name": DEFAULT_MODEL}


def scrape(server) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, for every sample of every family."""
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({**MODEL, **labels}.items()))), 0.0)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_every_vllm_metric_is_exported_under_its_name_with_the_model_name_label(tp1):
    r = httpx.get(f"{tp1.url}/metrics", timeout=10)
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    gauges = ["neuron:num_requests_running", "neuron:num_requests_waiting", "neuron:kv_cache_usage_perc"]
    counters = ["neuron:num_preemptions", "neuron:prefix_cache_queries", "neuron:prefix_cache_hits",
                "neuron:prompt_tokens", "neuron:generation_tokens", "neuron:request_success"]
    histograms = ["neuron:time_to_first_token_seconds", "neuron:inter_token_latency_seconds",
                  "neuron:e2e_request_latency_seconds", "neuron:request_queue_time_seconds",
                  "neuron:request_prompt_tokens", "neuron:request_generation_tokens"]
    for name, kind in [(g, "gauge") for g in gauges] + [(c, "counter") for c in counters] + \
                      [(h, "histogram") for h in histograms]:
        assert name in families and families[name].type == kind, name
    for name in gauges + ["neuron:num_preemptions", "neuron:prefix_cache_hits"]:
        assert any(s.labels.get("model_name") == DEFAULT_MODEL for s in families[name].samples), name


def test_counters_and_histograms_move_by_exactly_what_three_known_requests_did(tp1):
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    before = scrape(tp1)
    prompts = []
    for _ in range(2):
        r = httpx.post(f"{tp1.base}/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        prompts.append(r.json()["usage"]["prompt_tokens"])
    stream = body | {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{tp1.base}/chat/completions", json=stream, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    prompts.append(chunks[-1]["usage"]["prompt_tokens"])
    after = scrape(tp1)

    assert delta(before, after, "neuron:generation_tokens_total") == 15
    assert delta(before, after, "neuron:prompt_tokens_total") == sum(prompts)
    assert delta(before, after, "neuron:request_success_total", finished_reason="length") == 3
    assert delta(before, after, "neuron:request_success_total", finished_reason="stop") == 0
    assert delta(before, after, "neuron:requests_started_total") == 3
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert delta(before, after, f"neuron:{name}_count") == 3, name
    assert delta(before, after, "neuron:inter_token_latency_seconds_count") == 3 * 4  # 5 tokens, 4 gaps each
    assert delta(before, after, "neuron:request_generation_tokens_sum") == 15
    assert delta(before, after, "neuron:request_prompt_tokens_sum") == sum(prompts)
    # Prompts of ~30 tokens fall in the le=50 bucket and not in le=20; 5 generated tokens in le=5.
    assert delta(before, after, "neuron:request_prompt_tokens_bucket", le="50.0") == 3
    assert delta(before, after, "neuron:request_generation_tokens_bucket", le="5.0") == 3
    assert delta(before, after, "neuron:request_generation_tokens_bucket", le="2.0") == 0
    ttft = delta(before, after, "neuron:time_to_first_token_seconds_sum")
    itl = delta(before, after, "neuron:inter_token_latency_seconds_sum")
    e2e = delta(before, after, "neuron:e2e_request_latency_seconds_sum")
    queue = delta(before, after, "neuron:request_queue_time_seconds_sum")
    assert 0 <= queue < ttft and 0 < itl and ttft + itl <= e2e + 1e-6
    assert value(after, "neuron:num_requests_running") == value(after, "neuron:num_requests_waiting") == 0


def test_a_refused_request_moves_no_token_counter(tp1):
    before = scrape(tp1)
    r = httpx.post(f"{tp1.base}/chat/completions", json={"model": DEFAULT_MODEL, "messages": [], "max_tokens": 5},
                   timeout=30)
    assert r.status_code == 400
    after = scrape(tp1)
    for name in ("neuron:prompt_tokens_total", "neuron:generation_tokens_total", "neuron:requests_started_total",
                 "neuron:e2e_request_latency_seconds_count"):
        assert delta(before, after, name) == 0, name
