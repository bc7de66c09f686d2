"""An engine core beside API processes (``[server] api_processes``): the same answers as one
process, token for token; 256 concurrent streams each equal to its request run alone; an API
process killed mid-stream ends only its own streams and comes back; SIGTERM drains them all."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from conftest import DEFAULT_MODEL, alive, api_pids, chat, greedy_ids, start_server

SPLIT = """
[server]
api_processes = 2
[engine]
queue_size = 256
max_queue_wait_s = 600
[[models]]
model = "SmolLM2-135M-Instruct"
max_model_len = 256
max_slots = 64
"""


@pytest.fixture(scope="module")
def split(server_tmp):
    server = start_server(server_tmp, config=SPLIT)
    yield server
    server.stop()


def served_by(server, request_id: str) -> int | None:
    """Which API process logged the request's start."""
    found = re.search(rf"api-(\d+) INFO neuron.request: request started request_id={re.escape(request_id)} ",
                      server.log())
    return int(found.group(1)) if found else None


def test_answers_are_the_one_process_answers_token_for_token(split, tp1):
    for prompt in ("Name three colours.", "What is 2 + 2?"):
        assert greedy_ids(split, prompt, 24) == greedy_ids(tp1, prompt, 24)
    # Stop strings are the API process's: the text ends before the stop, the usage counts to it.
    a, b = (chat(s, "Count from one to ten, in words.", max_tokens=40, stop=[" five"]) for s in (split, tp1))
    assert a.status_code == b.status_code == 200
    assert a.json()["choices"][0] == b.json()["choices"][0]
    assert a.json()["usage"] == b.json()["usage"]
    assert len(api_pids(split)) == 2


def test_a_stored_response_is_found_through_every_api_process(split):
    first = httpx.post(f"{split.base}/responses", json={"model": DEFAULT_MODEL, "input": "Name a fruit.",
                                                        "max_output_tokens": 8, "temperature": 0}, timeout=60)
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    served: list[str] = []
    # A new connection each: the kernel spreads them over both processes, not evenly (a run once
    # sent 17 in a row to one), so until each has served some.
    for _ in range(48):
        r = httpx.get(f"{split.base}/responses/{rid}", timeout=30)
        assert r.status_code == 200 and r.json()["id"] == rid
        follow = httpx.post(f"{split.base}/responses", json={"model": DEFAULT_MODEL, "input": "And another?",
                                                             "previous_response_id": rid, "max_output_tokens": 4},
                            timeout=60)
        assert follow.status_code == 200, follow.text
        served = [m.group(1) for m in re.finditer(
            r"api-(\d+) INFO neuron.request: request started .*route=/v1/responses", split.log())]
        if set(served) == {"0", "1"}:
            break
    assert set(served) == {"0", "1"}, served


def test_constrained_requests_run_their_constraint_in_the_api_process(split, tp1):
    # Bounded, so that the answer ends within its tokens and is checked whole.
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    answers = []
    for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
                  {"allowed_token_ids": [504, 2229, 476, 100, 28]}, {"response_format": {"type": "json_object"}}):
        a, b = (chat(s, "Describe a person as JSON.", max_tokens=60, return_token_ids=True, **extra)
                for s in (split, tp1))
        assert a.status_code == b.status_code == 200, (a.text, extra)
        assert a.json()["choices"][0] == b.json()["choices"][0], extra
        answers.append(a.json()["choices"][0])
    assert set(answers[1]["token_ids"]) <= {504, 2229, 476, 100, 28}
    assert answers[0]["finish_reason"] == "stop", answers[0]
    assert set(json.loads(answers[0]["message"]["content"])) == {"name", "age"}


def alone_with_runner_up(server, prompt: str, max_tokens: int) -> tuple[list[int], list[float]]:
    """The greedy ids of ``prompt`` run alone, and at each the gap to the runner-up's logprob."""
    r = chat(server, prompt, max_tokens=max_tokens, return_token_ids=True, logprobs=True, top_logprobs=2)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    gaps = [c["top_logprobs"][0]["logprob"] - c["top_logprobs"][1]["logprob"] for c in choice["logprobs"]["content"]]
    return choice["token_ids"], gaps


TIE = 0.02  # logprobs this close are a tie that batched and lone kernels may break either way


def test_256_concurrent_streams_each_equal_to_its_request_alone(split):
    prompts = [f"Write a word that rhymes with number {i}." for i in range(32)]
    alone = {p: alone_with_runner_up(split, p, 12) for p in prompts}

    async def stream(http: httpx.AsyncClient, prompt: str) -> list[int]:
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": 12, "stream": True, "return_token_ids": True}
        ids, done = [], False
        async with http.stream("POST", f"{split.base}/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    for choice in json.loads(line[6:]).get("choices", []):
                        ids += choice.get("token_ids") or []
        assert done
        return ids

    async def all_at_once() -> list[list[int]]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*(stream(http, prompts[i % 32]) for i in range(256)))

    got = asyncio.run(all_at_once())
    for i, ids in enumerate(got):
        want, gaps = alone[prompts[i % 32]]
        if ids != want:  # only where the lone run's choice was a tie (the CPU's batched kernels sum in another order)
            k = next(k for k, (a, b) in enumerate(zip(ids, want)) if a != b)
            assert ids[:k] == want[:k] and gaps[k] < TIE, (i, ids, want, gaps)
    assert sum(got[i] == alone[prompts[i % 32]][0] for i in range(256)) >= 224
    info = httpx.get(f"{split.url}/models", timeout=10).json()["models"][0]
    assert (info["running"], info["waiting"], info["slots_used"]) == (0, 0, 0)


class Stream(threading.Thread):
    def __init__(self, server, request_id: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.request_id, self.max_tokens = server, request_id, max_tokens
        self.chunks, self.done, self.error = 0, False, None
        self.started = threading.Event()

    def run(self) -> None:
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.server.base}/chat/completions", json=body, timeout=120,
                              headers={"x-request-id": self.request_id}) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.chunks += 1
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = exc
        self.started.set()


def test_a_peer_without_the_runs_token_is_not_heard_and_not_waited_for(split):
    """Another program of the same user on the core's socket: it says Hello with no token and never
    acknowledges a models' state. A load and an unload do not wait for it."""
    import zmq

    import protocol.api_core as m
    from conftest import cmdline

    argv = cmdline(next(iter(api_pids(split).values()))).split(b"\0")
    endpoint = argv[argv.index(b"--core") + 1].decode()
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.IDENTITY, b"rogue")
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(endpoint)
    try:
        for frame in (m.Hello(4242), m.Hello(4242, "0" * 32), m.Call(1, "models")):
            rogue.send(m.encode(frame))
        for path, body in (("/models/load", {"model": "SmolLM2-135M-Instruct", "id": "rogue-test", "max_model_len": 256}),
                           ("/models/unload", {"model": "rogue-test"})):
            t0 = time.monotonic()
            r = httpx.post(f"{split.url}{path}", json=body, timeout=120)
            assert r.status_code == 200 and time.monotonic() - t0 < 20, (path, r.text, time.monotonic() - t0)
        assert not rogue.poll(200), "the core answered a peer without the token"
        assert "(b'rogue') has not shown this run's token" in split.log()
        assert "did not apply the models' state" not in split.log()  # nobody was waited for
    finally:
        rogue.close()
        ctx.term()


def test_a_killed_api_process_ends_only_its_streams_and_comes_back(split):
    streams: list[Stream] = []
    by_process: dict[int, list[Stream]] = {}
    for i in range(24):  # until both processes serve some (the kernel picks who accepts)
        s = Stream(split, f"kill-{os.getpid()}-{i}", 200)
        s.start()
        assert s.started.wait(60)
        streams.append(s)
        by_process.setdefault(served_by(split, s.request_id), []).append(s)
        if len(by_process) == 2 and len(streams) >= 4:
            break
    assert set(by_process) == {0, 1}, by_process
    before = api_pids(split)
    os.kill(before[0], signal.SIGKILL)
    for s in streams:
        s.join(120)
    assert all(not s.done for s in by_process[0])
    assert all(s.done and s.error is None and s.chunks > 100 for s in by_process[1])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (len(api_pids(split)) == 2 and api_pids(split)[0] != before[0]):
        time.sleep(0.2)
    after = api_pids(split)
    assert after[1] == before[1] and after[0] != before[0] and not alive(before[0])
    assert "API process 0 (pid %d) exited" % before[0] in split.log()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and httpx.get(f"{split.url}/health", timeout=5).status_code != 200:
        time.sleep(0.2)
    for _ in range(6):  # whichever process takes them
        r = chat(split, "Say hi.", max_tokens=4)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    info = httpx.get(f"{split.url}/models", timeout=10).json()["models"][0]
    assert (info["running"], info["slots_used"]) == (0, 0)  # the killed streams' slots came back


def test_sigterm_drains_every_api_process_then_everything_exits(server_tmp):
    server = start_server(server_tmp, config=SPLIT)
    pids = list(api_pids(server).values()) + server.rank_pids()
    assert len(pids) == 3
    streams = [Stream(server, f"drain-{i}", 60) for i in range(4)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    for s in streams:
        s.join(30)
        assert s.done and s.chunks > 30, (s.request_id, s.chunks, s.error)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_auto_api_processes_follow_the_cpus_and_a_number_or_auto_is_all_it_takes():
    from neuron.config import ConfigError, ServerConfig, load_config, validate
    from neuron.core.api_processes import api_process_count

    assert [api_process_count(ServerConfig(), cpus, gpus=1) for cpus in (2, 4, 7, 8, 12, 16, 64)] == [0, 0, 0, 2, 3, 4, 4]
    assert api_process_count(ServerConfig(), 64, gpus=0) == 0  # CPU ranks need the cores
    assert load_config(None, env={}).server.api_processes == "auto"
    cfg = load_config(None, env={"NEURON_SERVER__API_PROCESSES": "3"})
    validate(cfg)
    assert api_process_count(cfg.server, cpus=2) == 3  # a number is taken as it is
    for bad in ("many", "65", "-1"):
        with pytest.raises(ConfigError, match="(?i)api_processes"):
            validate(load_config(None, env={"NEURON_SERVER__API_PROCESSES": bad}))
