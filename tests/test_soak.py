"""Soak: 32 concurrent streams for 30 seconds (``NEURON_SOAK_SECONDS`` for longer), with clients
that walk away at random. Every stream that completes is whole, nothing leaks, memory stays flat
from 20 seconds in to the end. A slow machine soaks longer (up to three times as long), until
``COMPLETED`` streams have been whole."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time

import httpx
import pytest

from conftest import DEFAULT_MODEL, start_server

SOAK_SECONDS = float(os.environ.get("NEURON_SOAK_SECONDS", "30"))  # longer: NEURON_SOAK_SECONDS (45 took 52 s of a 1,014 s suite)
STREAMS = 32
COMPLETED = 60
PROMPTS = ["What is the capital of France?", "Name three animals.", "What color is the sky?",
           "Say something kind.", "What is 3 times 4?", "Describe a tree."]
CONFIG = """
[[models]]
model = "SmolLM2-135M-Instruct"
max_model_len = 512
max_slots = 8
[engine]
queue_size = 64
max_queue_wait_s = 120
"""


def rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def body(prompt: str, stream: bool) -> dict:
    return {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": 24, "stream": stream}


@pytest.mark.slow
@pytest.mark.timeout(600)  # three soaks' worth on a slow machine, and the server's start and stop
def test_soak_with_random_disconnects_loses_nothing_and_leaks_nothing(server_tmp):
    server = start_server(server_tmp, config=CONFIG)
    try:
        reference = {p: httpx.post(f"{server.base}/chat/completions", json=body(p, False), timeout=120)
                     .json()["choices"][0]["message"]["content"] for p in PROMPTS}
        stats = asyncio.run(soak(server, reference))
        assert stats["completed"] >= COMPLETED, stats
        assert stats["dropped"] >= 10, stats
        assert stats["mismatched"] == [], stats["mismatched"][:3]
        info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        assert (info["slots_used"], info["running"], info["waiting"]) == (0, 0, 0)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        started = float(re.search(r'neuron:requests_started_total\{model_name="[^"]+"\} (\S+)', metrics).group(1))
        finished = sum(float(x) for x in re.findall(r'neuron:request_success_total\{[^}]*\} (\S+)', metrics))
        assert started == finished == stats["sent"] + len(PROMPTS)
        growth_mb = (stats["rss_end"] - stats["rss_start"]) / 1024
        assert growth_mb < 64, f"memory grew by {growth_mb:.0f} MB"
        print(f"soak: {stats['sent']} streams, {stats['completed']} completed, {stats['dropped']} dropped, "
              f"rss {stats['rss_start'] // 1024} -> {stats['rss_end'] // 1024} MB")
    finally:
        assert server.stop() == 0


async def soak(server, reference: dict) -> dict:
    rng = random.Random(20261122)
    pids = [server.proc.pid, *server.rank_pids()]
    stats = {"sent": 0, "completed": 0, "dropped": 0, "mismatched": [], "rss_start": 0, "rss_end": 0}
    end, last = time.monotonic() + SOAK_SECONDS, time.monotonic() + 3 * SOAK_SECONDS
    warm_at = time.monotonic() + 20

    async def one_stream(http: httpx.AsyncClient) -> None:
        prompt = rng.choice(PROMPTS)
        walk_away = rng.random() < 0.3
        after = rng.randint(0, 6)
        stats["sent"] += 1
        text, seen, finish = [], 0, None
        async with http.stream("POST", f"{server.base}/chat/completions", json=body(prompt, True)) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                seen += 1
                if walk_away and seen > after:
                    stats["dropped"] += 1
                    return
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
        stats["completed"] += 1
        if "".join(text) != reference[prompt] or finish is None:
            stats["mismatched"].append((prompt, "".join(text), reference[prompt]))

    async def worker(http: httpx.AsyncClient) -> None:
        while (now := time.monotonic()) < end or (stats["completed"] < COMPLETED and now < last):
            await one_stream(http)
            if not stats["rss_start"] and time.monotonic() > warm_at:
                stats["rss_start"] = sum(rss_kb(p) for p in pids)

    limits = httpx.Limits(max_connections=STREAMS + 4, max_keepalive_connections=STREAMS)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(STREAMS)))
    await asyncio.sleep(1.0)
    stats["rss_end"] = sum(rss_kb(p) for p in pids)
    return stats
