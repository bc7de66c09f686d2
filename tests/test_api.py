"""The default model served at TP=1 over a real loopback server, through the official client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conftest import DEFAULT_MODEL, ROOT, chat

QUESTION = "What is the capital of France?"


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def test_the_openai_client_gets_paris_without_streaming(tp1):
    out = client(tp1).chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens > 0 and out.usage.prompt_tokens > 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_the_openai_client_streams_paris_in_several_chunks(tp1):
    stream = client(tp1).chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(content) >= 3
    assert "Paris" in "".join(content)
    assert finishes == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(content) + 1 or \
        chunks[-1].usage.completion_tokens >= len(content)


def test_the_raw_stream_ends_with_done(tp1):
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{tp1.base}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    finish = json.loads(lines[-2][6:])
    assert finish["choices"][0]["finish_reason"] == "stop"


def test_text_completions_and_the_models_list(tp1):
    out = client(tp1).completions.create(model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=5,
                                         temperature=0)
    assert "Paris" in out.choices[0].text
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    ids = [m.id for m in client(tp1).models.list().data]
    assert ids == [DEFAULT_MODEL]


def test_stop_strings_are_never_shown_and_end_the_answer(tp1):
    r = chat(tp1, QUESTION, stop=["Paris"])
    body = r.json()
    assert r.status_code == 200
    text = body["choices"][0]["message"]["content"]
    assert "Paris" not in text and text.startswith("The capital of France is")
    assert body["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_repeats_and_logprobs_are_returned(tp1):
    kw = dict(temperature=1.0, seed=1234, max_tokens=12)
    a, b = chat(tp1, "Tell me a story.", **kw).json(), chat(tp1, "Tell me a story.", **kw).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    r = chat(tp1, QUESTION, logprobs=True, top_logprobs=3, max_tokens=4).json()
    entries = r["choices"][0]["logprobs"]["content"]
    assert len(entries) == 4
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 3 for e in entries)
    # greedy: the chosen token is the most likely one
    assert all(abs(e["logprob"] - e["top_logprobs"][0]["logprob"]) < 1e-5 for e in entries)


PROMPTS = [QUESTION, "What is 2 + 2?", "Name a color.", "What is the capital of Italy?",
           "Say hello in French.", "What is the largest planet?", "Who wrote Hamlet?", "What is water made of?"]


def test_eight_concurrent_requests_each_get_their_own_answer(tp1):
    alone = [chat(tp1, q, max_tokens=24).json()["choices"][0]["message"]["content"] for q in PROMPTS]

    async def together():
        async with httpx.AsyncClient(timeout=180) as http:
            async def one(q):
                body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": q}], "temperature": 0,
                        "max_tokens": 24}
                r = await http.post(f"{tp1.base}/chat/completions", json=body)
                return r.json()["choices"][0]["message"]["content"]
            return await asyncio.gather(*(one(q) for q in PROMPTS))

    assert asyncio.run(together()) == alone
    assert "Paris" in alone[0] and len(set(alone)) == len(PROMPTS)


def slots_in_use(server) -> tuple[int, int, int]:
    m = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
    return m["slots_used"], m["running"], m["waiting"]


def test_a_client_that_drops_a_stream_disturbs_nothing(tp1):
    expected = chat(tp1, QUESTION).json()["choices"][0]["message"]["content"]
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Write a long essay about the sea."}],
            "temperature": 0, "stream": True, "max_tokens": 500}
    with httpx.stream("POST", f"{tp1.base}/chat/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen == 3:  # the role chunk and two content chunks
                break
    deadline = time.monotonic() + 10
    while slots_in_use(tp1) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert slots_in_use(tp1) == (0, 0, 0)
    assert chat(tp1, QUESTION).json()["choices"][0]["message"]["content"] == expected
    assert "finished: abort" in tp1.log()


def test_the_tap_shows_the_frames_of_a_live_request(tp1, tap_endpoint):
    tap = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "neuron-tap"), "--endpoint", tap_endpoint,
                            "--json", "--no-heartbeats", "--timeout", "30", "--count", "6"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # let the subscription settle: PUB drops what no one listens to
    assert chat(tp1, QUESTION, max_tokens=8).status_code == 200
    out, _ = tap.communicate(timeout=60)
    frames = [json.loads(line) for line in out.splitlines()]
    ops = [f["op"] for f in frames]
    assert "step" in ops and "step_result" in ops
    step = next(f for f in frames if f["op"] == "step")
    assert step["dir"] == "send" and step["model"] == DEFAULT_MODEL and step["frame"]["seqs"]
    result = next(f for f in frames if f["op"] == "step_result")
    assert result["dir"] == "recv" and result["rank"] == 0 and len(result["frame"]["tokens"]) >= 1


def test_the_tap_prints_text_lines(tp1, tap_endpoint):
    tap = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "neuron-tap"), "--endpoint", tap_endpoint,
                            "--op", "step", "--timeout", "30", "--count", "2"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    chat(tp1, QUESTION, max_tokens=4)
    out, _ = tap.communicate(timeout=60)
    lines = out.splitlines()
    assert len(lines) == 2 and all(" -> rank0 step " in line and "seqs=" in line for line in lines)


@pytest.mark.parametrize("body,status,code,param", [
    (b"{not json", 400, "invalid_request", None),
    ({"model": DEFAULT_MODEL, "messages": []}, 400, "invalid_request", "messages"),
    ({"model": DEFAULT_MODEL}, 400, "invalid_request", "messages"),
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found", "model"),
    ({"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5},
     400, "invalid_request", "max_tokens"),
    ({"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"},
     400, "invalid_request", "max_tokens"),
    ({"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi " * 3000}]},
     400, "context_length_exceeded", "messages"),
    ({"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
     400, "context_length_exceeded", "messages"),
    ({"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
     400, "invalid_request", "temperature"),
    ({"model": DEFAULT_MODEL, "messages": "hello"}, 400, "invalid_request", "messages"),
    ([1, 2, 3], 400, "invalid_request", None),
])
def test_bad_input_gets_the_documented_status_and_the_server_stays_healthy(tp1, body, status, code, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{tp1.base}/chat/completions", timeout=30, headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    if param is not None:
        assert err["param"] == param
    assert httpx.get(f"{tp1.url}/health", timeout=10).status_code == 200


def test_health_and_models_describe_the_loaded_model(tp1):
    h = httpx.get(f"{tp1.url}/health", timeout=10).json()
    assert {k: h[k] for k in ("status", "models")} == {"status": "ok", "models": {DEFAULT_MODEL: "loaded"}}
    assert [rank["device"] for rank in h["devices"][DEFAULT_MODEL]] == ["cpu"]
    m = httpx.get(f"{tp1.url}/models", timeout=10).json()["models"][0]
    assert m["status"] == "loaded" and m["tensor_parallel"] == 1 and m["dtype"] == "float32"
    assert m["format"] == "gguf" and m["family"] == "llama"
    metrics = httpx.get(f"{tp1.url}/metrics", timeout=10).text
    assert 'neuron:model_status{model_name="SmolLM2-135M-Instruct",status="loaded"} 1.0' in metrics


def test_token_ids_and_ignore_eos_extensions(tp1):
    body = {"model": DEFAULT_MODEL, "prompt": "The capital of France is", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    out = httpx.post(f"{tp1.base}/completions", json=body, timeout=120).json()
    assert out["usage"]["completion_tokens"] == 40 and len(out["choices"][0]["token_ids"]) == 40
    assert out["choices"][0]["finish_reason"] == "length"
    streamed: list[int] = []
    with httpx.stream("POST", f"{tp1.base}/completions", json=body | {"stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += choice.get("token_ids", [])
    assert streamed == out["choices"][0]["token_ids"]


def test_a_reader_that_never_reads_does_not_slow_other_streams(tp1):
    import socket

    def three_answers() -> float:
        t0 = time.monotonic()
        answers = [chat(tp1, QUESTION, max_tokens=16).json()["choices"][0]["message"]["content"] for _ in range(3)]
        assert all("Paris" in a for a in answers)
        return time.monotonic() - t0

    alone = three_answers()
    host, port = tp1.url.removeprefix("http://").split(":")
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect((host, int(port)))
    payload = json.dumps({"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Write a long poem."}],
                          "temperature": 0, "max_tokens": 600, "ignore_eos": True, "stream": True}).encode()
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    try:
        time.sleep(2.0)
        # The stalled stream still decodes beside them (a batch of two), but nothing waits on it.
        assert three_answers() < 3 * alone + 10
    finally:
        stalled.close()
    deadline = time.monotonic() + 30
    while slots_in_use(tp1) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert slots_in_use(tp1) == (0, 0, 0)


def test_unknown_paths_and_methods_get_the_error_envelope(tp1):
    r = httpx.get(f"{tp1.url}/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{tp1.base}/chat/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
