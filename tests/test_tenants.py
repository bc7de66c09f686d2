"""Tenants that cannot hurt each other or the operator, against a real server with a keys file
and no admin key: the admin routes closed (403 naming admin_api_key, on loopback too); what a web
page could send refused (a text/plain unload, a cross-site Origin); a principal header believed
only from a gateway's key; the principals named in /metrics capped; integer fields bounded;
``keys add`` checking before it writes; keys files others can read refused."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re

import httpx
import pytest

from conftest import access_line, api_pids, start_server
from neuron.server.keys import KeysFileError, add_key, read_keys_file

ALICE, BOB, GATE = "nk-alice-0123456789", "nk-bob-0123456789", "nk-gate-0123456789"


def entry(name: str, key: str, extra: str = "") -> str:
    return f'[[keys]]\nname = "{name}"\nkey_sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n{extra}'


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    from devtools.checkpoints import make_checkpoint

    tmp = tmp_path_factory.mktemp("tenants")
    checkpoint = make_checkpoint("llama", tmp / "tiny", seed=3)
    keys = tmp / "keys.toml"
    keys.write_text(entry("alice", ALICE) + entry("bob", BOB) + entry("gate", GATE, "gateway = true\n"))
    keys.chmod(0o600)
    server = start_server(tmp, config=f'[[models]]\nmodel = "{checkpoint}"\nid = "tiny"\nmax_model_len = 256\n'
                                      f'[server]\napi_keys_file = "{keys}"\nprincipal_header = "x-account-id"\n'
                                      'max_principals = 3\nmetrics_public = true\napi_processes = 2\n')
    yield server
    server.stop()


def ask(server, key: str, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(f"{server.base}/completions", timeout=60, headers={"authorization": f"Bearer {key}",
                                                                        **(headers or {})},
                      json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, **body})


def principal_of(server, rid: str) -> str:
    return re.search(r"principal=(\S+)", access_line(server, rid)).group(1)


def test_admin_routes_are_closed_without_an_admin_key(tenants):
    for method, path, body in (("POST", "/models/unload", {"model": "tiny"}), ("POST", "/models/load",
                               {"model": "SmolLM2-135M-Instruct"}), ("GET", "/models", None)):
        for key in (None, ALICE, GATE):  # no key, a named key, a gateway's: none opens them
            r = httpx.request(method, f"{tenants.url}{path}", json=body, timeout=30,
                              headers={"authorization": f"Bearer {key}"} if key else {})
            assert r.status_code == 403 and "admin_api_key" in r.json()["error"]["message"], (path, key, r.text)
    assert httpx.get(f"{tenants.url}/health", timeout=10).json()["models"] == {"tiny": "loaded"}


def test_what_a_web_page_can_send_is_refused(tenants):
    r = httpx.post(f"{tenants.url}/models/unload", content=b'{"model": "tiny"}', timeout=10,
                   headers={"content-type": "text/plain", "origin": "http://evil.example"})
    assert r.status_code == 415, r.text
    r = httpx.post(f"{tenants.base}/completions", timeout=10, headers={"authorization": f"Bearer {ALICE}",
                                                                       "origin": "http://evil.example"},
                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request"
    own = tenants.url.removeprefix("http://")
    r = httpx.post(f"{tenants.base}/completions", timeout=60, headers={"authorization": f"Bearer {ALICE}",
                                                                       "origin": f"http://{own}"},
                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert httpx.get(f"{tenants.url}/health", timeout=10).json()["models"] == {"tiny": "loaded"}


def test_a_principal_header_counts_only_from_a_gateway_key(tenants):
    assert ask(tenants, BOB, {"x-account-id": "alice", "x-request-id": "spoof"}).status_code == 200
    assert principal_of(tenants, "spoof") == "bob"  # ignored: bob's key is no gateway's
    assert ask(tenants, GATE, {"x-account-id": "acct-9", "x-request-id": "gw"}).status_code == 200
    assert principal_of(tenants, "gw") == "acct-9"
    assert "x-account-id from key 'bob' ignored" in tenants.log()


def test_the_principals_named_in_metrics_are_capped(tenants):
    for i in range(8):
        assert ask(tenants, GATE, {"x-account-id": f"many-{i}"}).status_code == 200
    text = httpx.get(f"{tenants.url}/metrics", timeout=10).text
    named = set(re.findall(r'neuron:principal_requests_total\{principal="([^"]+)"', text))
    assert len(named) <= 4 and "other" in named, named  # max_principals = 3, and "other"


BIG = 2**70
INTEGERS = ["max_tokens", "max_completion_tokens", "top_k", "seed", "n", "best_of", "min_tokens",
            "truncate_prompt_tokens", "prompt_logprobs", "priority", "max_repetition_pattern_size",
            "min_repetition_pattern_size", "repetition_min_count", "thinking_token_budget"]
# Too large is no harm for these: the most there is (top_k past the vocabulary keeps every token,
# truncation past the prompt keeps it whole); too large a budget is the context's 400.
AT_MOST = {"top_k": 200, "truncate_prompt_tokens": 200, "max_tokens": "messages", "max_completion_tokens": "messages",
           "max_output_tokens": "input"}


def test_every_integer_field_out_of_range_is_a_400_naming_it(tenants):
    for route, body, fields in (("completions", {"prompt": "Hi"}, [*INTEGERS, "logprobs"]),
                                ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
                                 [*INTEGERS, "top_logprobs"]),
                                ("responses", {"input": "Hi"}, ["max_output_tokens", "max_tool_calls"])):
        for field in fields:
            for value in (BIG, -BIG, 2**64, -(2**63) - 1):
                r = httpx.post(f"{tenants.base}/{route}", timeout=60, headers={"authorization": f"Bearer {ALICE}"},
                               json={"model": "tiny", "max_tokens": 2, **body, field: value})
                if value > 0 and field in AT_MOST:
                    want = "prompt" if AT_MOST[field] == "messages" and route == "completions" else AT_MOST[field]
                    assert r.status_code == want if want == 200 else r.json()["error"]["param"] == want, (field, r.text)
                    continue
                assert r.status_code == 400 and r.json()["error"]["param"] == field, (route, field, value, r.text)
    for value in (-1, 2**31):
        assert ask(tenants, ALICE, priority=value if value > 0 else -(2**31) - 1).status_code == 400


def api_rss(server) -> int:
    """The API processes' resident memory, in bytes."""
    pids = list(api_pids(server).values())
    assert len(pids) == 2
    return sum(int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") for pid in pids)


def test_failing_requests_cost_the_api_processes_no_memory(tenants):
    body = {"model": "tiny", "prompt": "The lighthouse keeper " * 20, "max_tokens": 2, "priority": 2**64}
    with httpx.Client(base_url=tenants.base, timeout=60, headers={"authorization": f"Bearer {ALICE}"}) as client:
        def fail(n: int) -> None:
            for _ in range(n):
                assert client.post("/completions", json=body).status_code == 400
        fail(300)  # the allocator's pools settle
        before = api_rss(tenants)
        fail(2000)
        grown = api_rss(tenants) - before
    assert grown < 8 << 20, f"{grown / 2**20:.1f} MiB for 2,000 refused requests"


def test_a_request_the_core_link_cannot_send_leaves_nothing_behind():
    """The leak behind the 500s: a request kept before it was encoded stayed kept forever."""
    from neuron.server.core_link import CoreLink
    from neuron.server.output.state import OutputState
    from protocol import Sampling
    from protocol.api_core import EngineRequest

    async def main():
        link = CoreLink("ipc:///nonexistent/neuron-core.sock", "token", on_models=None)
        try:
            wire = EngineRequest("req-1", [1, 2, 3, 4], Sampling(temperature=0.0), 2, [],
                                 priority=2**64)  # past what the wire carries
            req = OutputState(wire, None, None)
            with pytest.raises(OverflowError):
                link.submit("tiny", req)
            assert not link.requests and not link.key_of
        finally:
            link.close()
    asyncio.run(main())


def test_keys_add_checks_before_it_writes(tmp_path):
    path = tmp_path / "keys.toml"
    add_key(str(path), "first")
    before = path.read_bytes()
    for kw in (dict(weight=0), dict(weight=float("nan")), dict(weight=-1), dict(max_running=-1)):
        with pytest.raises(KeysFileError):
            add_key(str(path), "careless", **kw)
        assert path.read_bytes() == before
    with pytest.raises(KeysFileError):
        add_key(str(path), "first")
    assert oct(path.stat().st_mode & 0o777) == "0o600" and [e.principal.name for e in read_keys_file(str(path))] == ["first"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_keys_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "keys.toml"
    add_key(str(path), "one")
    path.chmod(0o644)
    with pytest.raises(KeysFileError, match="chmod 600"):
        read_keys_file(str(path))
