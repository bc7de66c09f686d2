"""Failures are visible and recovered from: a rank killed or frozen mid-stream, a device
out-of-memory in a step, an overloaded queue, a killed leader."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from conftest import DEFAULT_MODEL, alive, chat, start_server

FAULTS = """
[[models]]
model = "SmolLM2-135M-Instruct"
max_model_len = 512
max_slots = 4
[timeouts]
heartbeat_timeout_s = 2.0
step_base_s = 10.0
[debug]
fault_injection = true
"""


def describe(server) -> dict:
    return httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]


class Stream:
    """A streamed chat request read on a thread: its data lines, and when it ended."""

    def __init__(self, server, max_tokens: int = 400) -> None:
        self.lines: list[str] = []
        self.ended_at: float | None = None
        self.started = threading.Event()
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(server, body), daemon=True)
        self.thread.start()

    def _read(self, server, body) -> None:
        try:
            with httpx.stream("POST", f"{server.base}/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line)
                        if len(self.lines) >= 3:
                            self.started.set()
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def chunks(self) -> list[dict]:
        return [json.loads(x[6:]) for x in self.lines if x != "data: [DONE]"]


def wait_loaded(server, epoch: int, within: float) -> dict:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        info = describe(server)
        if info["status"] == "loaded" and info["epoch"] != epoch:
            return info
        time.sleep(0.2)
    raise AssertionError(f"not loaded again within {within}s: {describe(server)}")


@pytest.fixture(scope="module")
def tp2(server_tmp):
    server = start_server(server_tmp, config=FAULTS, args=["--tensor-parallel", "2"])
    yield server
    server.stop()


def assert_failed_then_recovered(server, stream: Stream, t_fault: float, old: dict, bound: float) -> None:
    stream.thread.join(bound + 10)
    assert stream.ended_at is not None and stream.ended_at - t_fault < bound, "the stream did not end in time"
    assert stream.lines[-1] == "data: [DONE]"
    chunks = stream.chunks()
    assert any("error" in c for c in chunks), chunks[-3:]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "abort"
    health = httpx.get(f"{server.url}/health", timeout=10)
    if health.status_code == 503:  # it may already have recovered
        assert DEFAULT_MODEL in health.text
    info = wait_loaded(server, old["epoch"], 60)
    assert info["recoveries"] == old["recoveries"] + 1
    assert not any(alive(pid) for pid in old["pids"])
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = chat(server, "What is the capital of France?")
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]


def test_kill_9_of_a_rank_mid_stream_fails_the_stream_fast_and_the_model_recovers(tp2):
    old = describe(tp2)
    stream = Stream(tp2)
    assert stream.started.wait(60)
    t_fault = time.monotonic()
    os.kill(old["pids"][1], signal.SIGKILL)
    stream.thread.join(10)
    health = httpx.get(f"{tp2.url}/health", timeout=10)
    assert health.status_code == 503 and DEFAULT_MODEL in health.json()["reason"]
    assert_failed_then_recovered(tp2, stream, t_fault, old, bound=5.0)


def test_a_frozen_rank_mid_step_fails_the_group_within_the_deadline(tp2):
    old = describe(tp2)
    stream = Stream(tp2)
    assert stream.started.wait(60)
    t_fault = time.monotonic()
    os.kill(old["pids"][0], signal.SIGSTOP)
    # heartbeat_timeout_s = 2: the group must fail well before the step deadline of 10 s
    assert_failed_then_recovered(tp2, stream, t_fault, old, bound=6.0)


@pytest.fixture(scope="module")
def small_queue(server_tmp):
    config = FAULTS.replace("max_slots = 4", "max_slots = 2") + "\n[engine]\nqueue_size = 8\nmax_queue_wait_s = 600\n"
    server = start_server(server_tmp, config=config)
    yield server
    server.stop()


def test_an_injected_out_of_memory_fails_only_the_requests_of_that_step(small_queue):
    server = small_queue
    old = describe(server)
    running = [Stream(server, max_tokens=300) for _ in range(2)]
    for s in running:
        assert s.started.wait(60)
    queued: dict = {}
    waiter = threading.Thread(target=lambda: queued.update(r=chat(server, "What is the capital of France?")))
    waiter.start()
    time.sleep(0.5)
    assert describe(server)["waiting"] == 1
    armed = httpx.post(f"{server.url}/debug/fault", json={"model": DEFAULT_MODEL, "rank": 0, "kind": "oom"})
    assert armed.status_code == 200, armed.text
    for s in running:
        s.thread.join(30)
        errors = [c["error"] for c in s.chunks() if "error" in c]
        assert errors and errors[0]["code"] == "insufficient_memory"
    waiter.join(60)
    assert queued["r"].status_code == 200 and "Paris" in queued["r"].json()["choices"][0]["message"]["content"]
    info = describe(server)
    assert info["status"] == "loaded" and info["epoch"] == old["epoch"] and info["recoveries"] == 0
    assert (info["slots_used"], info["running"], info["waiting"]) == (0, 0, 0)


def test_a_full_queue_refuses_with_429_and_everything_admitted_completes(small_queue):
    server = small_queue

    async def burst():
        async with httpx.AsyncClient(timeout=300) as http:
            async def one(i):
                body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}],
                        "temperature": 0, "max_tokens": 8, "ignore_eos": True}
                return await http.post(f"{server.base}/chat/completions", json=body)
            return await asyncio.gather(*(one(i) for i in range(64)))

    t0 = time.monotonic()
    responses = asyncio.run(burst())
    assert time.monotonic() - t0 < 240
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}
    refused = [r for r in responses if r.status_code == 429]
    done = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(done) == 64 and len(refused) >= 40 and len(done) >= 8  # queue_size = 8
    assert all(int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "rate_limit_exceeded"
               for r in refused)
    assert all(r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 8
               for r in done)
    info = describe(server)
    assert (info["slots_used"], info["running"], info["waiting"]) == (0, 0, 0)


def test_a_killed_leader_takes_its_ranks_with_it(server_tmp):
    server = start_server(server_tmp, config=FAULTS, args=["--tensor-parallel", "2"])
    ranks = describe(server)["pids"]
    assert len(ranks) == 2 and all(alive(p) for p in ranks)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    deadline = time.monotonic() + 5
    while any(alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in ranks)
