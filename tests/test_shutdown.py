"""SIGTERM drains: in-flight requests finish, new ones get 503, the daemon exits 0 and leaves
no rank process behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from conftest import DEFAULT_MODEL, SMALL, alive, start_server

DRAIN_S = 60


def test_sigterm_lets_in_flight_requests_finish_then_exits_cleanly(server_tmp):
    drain_on(server_tmp, lambda server: server.proc.send_signal(signal.SIGTERM))


def test_sigterm_to_the_whole_process_group_drains_too(server_tmp):
    """As systemd's stop or ``kill -TERM -PGID`` sends it: the ranks ignore it and keep serving
    the requests the leader drains, and no rank is respawned on the way out."""
    server = drain_on(server_tmp, lambda server: os.killpg(server.proc.pid, signal.SIGTERM))
    assert server.log().count("spawned 2 rank(s)") == 1 and "failed" not in server.log()


def drain_on(server_tmp, send):
    # A deadline far beyond what 48 tokens take even on a loaded CI machine: the test is about
    # the drain letting the stream finish, not about how fast the machine is.
    server = start_server(server_tmp, config=SMALL + f"\n[server]\ndrain_timeout_s = {DRAIN_S}\n",
                          args=["--tensor-parallel", "2"])
    ranks = server.rank_pids()
    assert len(ranks) == 2
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}],
                "temperature": 0, "max_tokens": 48, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base}/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    t0 = time.monotonic()
    send(server)
    time.sleep(0.3)
    refused = httpx.post(f"{server.base}/chat/completions", timeout=10, json={
        "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    reader.join(DRAIN_S)
    streamed = time.monotonic()
    code = server.proc.wait(20)
    assert code == 0 and streamed - t0 < DRAIN_S and time.monotonic() - streamed < 10
    assert lines[-1] == "data: [DONE]"
    finish = json.loads(lines[-2][6:])
    assert "choices" in finish, (finish, server.log()[-4000:])
    assert finish["choices"][0]["finish_reason"] == "length"
    content = [json.loads(x[6:])["choices"][0]["delta"].get("content") for x in lines[1:-2]]
    assert sum(1 for c in content if c) >= 30
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in ranks)
    assert "Traceback" not in server.log()
    return server
