"""Loading and unloading models at run time over the admin routes."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from conftest import DEFAULT_MODEL, alive, start_server

CONFIG = """
[[models]]
model = "SmolLM2-135M-Instruct"
max_model_len = 256
max_slots = 2
"""


def test_unload_then_load_again_with_concurrent_loads_coalescing(server_tmp):
    server = start_server(server_tmp, config=CONFIG)
    try:
        old = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        r = httpx.post(f"{server.url}/models/unload", json={"model": DEFAULT_MODEL}, timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "unloaded"
        assert httpx.get(f"{server.url}/models", timeout=10).json()["models"] == []
        assert not any(alive(pid) for pid in old["pids"])
        chat = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        gone = httpx.post(f"{server.base}/chat/completions", json=chat, timeout=10)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        unknown = httpx.post(f"{server.url}/models/unload", json={"model": DEFAULT_MODEL}, timeout=10)
        assert unknown.status_code == 404

        async def load_twice():
            async with httpx.AsyncClient(timeout=120) as http:
                req = {"model": DEFAULT_MODEL, "tensor_parallel": 2, "max_model_len": 128, "max_slots": 2}
                return await asyncio.gather(*(http.post(f"{server.url}/models/load", json=req) for _ in range(2)))

        a, b = asyncio.run(load_twice())
        assert a.status_code == b.status_code == 200
        assert a.json()["pids"] == b.json()["pids"] and len(a.json()["pids"]) == 2
        assert a.json()["tensor_parallel"] == 2 and a.json()["max_model_len"] == 128
        again = httpx.post(f"{server.base}/chat/completions", json=chat, timeout=60)
        assert again.status_code == 200
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        assert server.stop() == 0


def test_a_long_prompt_keeps_the_stream_alive_while_it_prefills(server_tmp):
    config = CONFIG.replace("max_model_len = 256", "max_model_len = 2048") + "\n[engine]\nprefill_chunk = 64\n"
    server = start_server(server_tmp, config=config)
    try:
        prompt = " ".join(f"word{i}" for i in range(300))
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
                "stream": True}
        with httpx.stream("POST", f"{server.base}/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            lines = [line for line in r.iter_lines() if line]
        first_content = next(i for i, line in enumerate(lines) if '"content":"' in line and '"role"' not in line)
        assert any(line == ": keep-alive" for line in lines[:first_content])
        assert lines[-1] == "data: [DONE]"
    finally:
        server.stop()


def test_a_startup_model_that_cannot_load_stops_the_daemon_with_a_clear_message(server_tmp):
    server = start_server(server_tmp, config=CONFIG, args=["--model", "/nonexistent/model.gguf"], healthy=False)
    code = server.proc.wait(60)
    assert code == 1
    assert "model path '/nonexistent/model.gguf' does not exist" in server.log()


def test_a_bad_config_file_is_refused_before_anything_starts(server_tmp):
    server = start_server(server_tmp, config="[server]\nport = 'eighty'\n", healthy=False)
    assert server.proc.wait(30) == 2
    assert "server.port: expected int" in server.log()


def test_a_request_while_the_startup_models_load_is_told_to_retry_and_the_sdk_gets_its_answer(server_tmp):
    """A client started beside the daemon (an agent under the same supervisor) asks before the
    default model serves: 503 with Retry-After, not 404, so the OpenAI SDK retries and gets its
    answer; once the startup is over, a name no model serves is 404."""
    server = start_server(server_tmp, config=CONFIG, healthy=False)
    try:
        deadline = time.monotonic() + 60
        while True:  # the port's first answer: the model is still loading
            try:
                health = httpx.get(f"{server.url}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and server.proc.poll() is None, server.log()[-2000:]
                time.sleep(0.02)
        assert health.status_code == 503 and health.json()["status"] == "starting", health.text
        chat = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        early = httpx.post(f"{server.base}/chat/completions", json=chat, timeout=10)
        assert early.status_code == 503 and early.json()["error"]["code"] == "model_unavailable", early.text
        assert int(early.headers["retry-after"]) > 0
        # Retry-After is 5 s: twenty retries give a load on a CPU many times slower than this one 100 s.
        client = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=20, timeout=60)
        answer = client.chat.completions.create(**chat)
        assert answer.choices[0].finish_reason in ("length", "stop")
        assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200
        gone = httpx.post(f"{server.base}/chat/completions", json={**chat, "model": "no-such-model"}, timeout=10)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    finally:
        server.stop()
