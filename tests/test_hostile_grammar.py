"""Grammars and schemas built to hurt the grammar engine (a 3000-rule chain, a 3000-deep $ref
chain, a 100k-entry choice, a few hundred random deep, wide and recursive ones) each get an
answer in bounded time, a 4xx naming the field when refused, and the daemon keeps serving."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import DEFAULT_MODEL, SMALL, start_server

CHAIN = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1} | "b"' for i in range(3000)) + '\nr3000: "z"'
REFS = {"$ref": "#/$defs/d0", "$defs": {
    **{f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(3000)},
    "d3000": {"type": "string"}}}
MESSAGES = [{"role": "user", "content": "Answer."}]


@pytest.fixture(scope="module")
def server(server_tmp):
    server = start_server(server_tmp, config=SMALL)
    yield server
    server.stop()


def _serving(server) -> None:
    assert server.proc.poll() is None, server.log()[-3000:]
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    r = httpx.post(f"{server.base}/chat/completions", timeout=60, json={
        "model": DEFAULT_MODEL, "messages": MESSAGES, "max_tokens": 4, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no")


def _refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param, r.text[:300]


@pytest.mark.parametrize("fields,param", [
    ({"guided_grammar": CHAIN}, "guided_grammar"),
    ({"structured_outputs": {"grammar": CHAIN}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": REFS}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": REFS}}], "tool_choice": "required"},
     "tools"),
    ({"guided_choice": [f"c{i}" for i in range(100_000)]}, "guided_choice"),
], ids=["lark-chain", "structured-chain", "ref-chain", "tool-ref-chain", "choice-100k"])
def test_a_hostile_grammar_gets_a_400_naming_its_field_and_the_daemon_serves_on(server, fields, param):
    t0 = time.monotonic()
    r = httpx.post(f"{server.base}/chat/completions", timeout=60,
                   json={"model": DEFAULT_MODEL, "messages": MESSAGES, "max_tokens": 4, **fields})
    assert time.monotonic() - t0 < 15
    _refused(r, param)
    _serving(server)


def test_a_ref_chain_in_the_responses_api_gets_a_400(server):
    r = httpx.post(f"{server.base}/responses", timeout=60, json={
        "model": DEFAULT_MODEL, "input": "Answer.", "max_output_tokens": 16,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": REFS}}})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"].startswith("text"), r.text[:300]
    _serving(server)


def test_a_chain_under_the_size_limits_is_refused_by_the_worker_not_the_leader(server):
    chain = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1} | "b"' for i in range(2500)) + '\nr2500: "z"'
    r = httpx.post(f"{server.base}/chat/completions", timeout=60,
                   json={"model": DEFAULT_MODEL, "messages": MESSAGES, "max_tokens": 4, "guided_grammar": chain})
    _refused(r, "guided_grammar")
    assert "grammar engine" in r.json()["error"]["message"]
    _serving(server)


# ------------------------------------------------------------------------------------ the fuzzer
def _lark(rng: random.Random) -> str:
    shape = rng.choice(["chain", "wide", "recursive", "nested", "junk"])
    n = rng.choice([1, 10, 100, 1000, 5000])
    if shape == "chain":
        return "start: r0\n" + "\n".join(f'r{i}: "{rng.choice("ab")}" r{i + 1} | "c"' for i in range(n)) + f'\nr{n}: "z"'
    if shape == "wide":
        return "start: " + " | ".join(f'"w{i}"' for i in range(n))
    if shape == "recursive":
        return rng.choice(['start: start "a" | "b"', 'start: "a" start | "b"', "start: x\nx: y\ny: x | \"q\"",
                           'start: "(" start ")" | ""', "start: start"])
    if shape == "nested":
        depth = rng.choice([10, 300, 3000])
        return "start: " + "(" * depth + '"a"' + ")*" * depth
    return "".join(rng.choice('start:|()"ab*+?/\\%json{}[]\n ') for _ in range(rng.randint(1, 200)))


def _schema(rng: random.Random, depth: int = 0):
    kind = rng.choice(["deep", "wide", "refs", "self", "anyof", "enum", "pattern", "junk"])
    n = rng.choice([1, 10, 100, 1000, 3000])
    if kind == "deep":
        node: dict = {"type": "string"}
        for _ in range(min(n, 200)):
            node = rng.choice([{"type": "array", "items": node}, {"type": "object", "properties": {"k": node}}])
        return node
    if kind == "wide":
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
                "required": [f"p{i}" for i in range(0, n, 2)]}
    if kind == "refs":
        return {"$ref": "#/$defs/d0", "$defs": {**{f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}
                                                    for i in range(min(n, 250))}, f"d{min(n, 250)}": {"type": "null"}}}
    if kind == "self":
        return {"$ref": "#/$defs/t", "$defs": {"t": {"type": "object", "properties": {
            "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "required": ["kids"]}}}
    if kind == "anyof":
        return {"anyOf": [{"const": f"v{i}"} for i in range(n)]}
    if kind == "enum":
        return {"enum": [rng.random() if rng.random() < 0.5 else f"e{i}" for i in range(n)]}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["(a|b)*c{1000,100000}", "(" * 500 + "a" + ")" * 500,
                                                         "[", "a{99999999}", "(?<=a)b", "\\p{L}+"])}
    return rng.choice([{"type": "bogus"}, {"$ref": "#/nowhere"}, {"properties": []}, {"minItems": -1,
                                                                                      "type": "array"}])


def _regex(rng: random.Random) -> str:
    return rng.choice(["(" * 3000 + "a" + ")" * 3000, "|".join(f"w{i}" for i in range(5000)), "a{1,1000000}",
                       "(a*)*b", "[z-a]", "(", "\\", "(?P<x>a)(?P=x)", "x" * 100_000])


def _fuzz_case(rng: random.Random) -> dict:
    field = rng.choice(["grammar", "schema", "tool", "regex", "choice"])
    if field == "grammar":
        return {"guided_grammar": _lark(rng)}
    if field == "schema":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": _schema(rng)}}}
    if field == "tool":
        return {"tools": [{"type": "function", "function": {"name": "f", "parameters": _schema(rng)}}],
                "tool_choice": "required"}
    if field == "regex":
        return {"guided_regex": _regex(rng)}
    return {"guided_choice": ["x" * rng.randint(1, 3000) for _ in range(rng.choice([1, 500, 3000]))]}


def test_a_few_hundred_random_hostile_grammars_each_get_an_answer_in_bounded_time(server):
    rng = random.Random(2026)
    cases = [_fuzz_case(rng) for _ in range(240)]

    def send(fields: dict) -> tuple[int, float, str]:
        t0 = time.monotonic()
        r = httpx.post(f"{server.base}/chat/completions", timeout=120,
                       json={"model": DEFAULT_MODEL, "messages": MESSAGES, "max_tokens": 4, **fields})
        return r.status_code, time.monotonic() - t0, r.text[:200]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, cases))
    for fields, (status, took, text) in zip(cases, results):
        assert status in (200, 400, 413), (status, text, json.dumps(fields)[:200])
        assert took < 60, (took, json.dumps(fields)[:200])
    assert sum(1 for status, _, _ in results if status == 400) > 40
    _serving(server)
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_a_grammar_worker_busy_when_the_leader_dies_leaves_too(tmp_path):
    """A worker mid-job is not left running (and spinning) after the leader is gone."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import ROOT, alive

    code = (
        "import os, subprocess, sys, time\n"
        "env = {**os.environ, 'NEURON_SANDBOX_PARENT': str(os.getpid())}\n"
        "w = subprocess.Popen([sys.executable, '-m', 'neuron.server.grammar.worker'], stdin=subprocess.PIPE, env=env)\n"
        "holder = subprocess.Popen(['sleep', '30'], pass_fds=[w.stdin.fileno()])\n"
        "print(w.pid, holder.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    # Another process holds the worker's stdin open past the leader's death, so no end of input
    # tells the worker to leave (as none does while a job runs): only the leader being gone can.
    leader = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    worker, holder = (int(x) for x in leader.stdout.readline().split())
    assert alive(worker)
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(worker)
    os.kill(holder, signal.SIGKILL)
