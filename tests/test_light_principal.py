"""A light principal is served within seconds whatever another does, against a real server on the
CPU: one key holds every slot with 600-token streams; another key's short request starts at the
next step (the newest stream gives its slot up, and is recomputed later), and the heavy streams
still end with the same tokens (one prompt: the recomputed one the same as those never stopped)."""

from __future__ import annotations

import hashlib
import threading
import time

import httpx
import pytest

from conftest import json_log, start_server

HEAVY, LIGHT, ADMIN = "nk-heavy-0123456789", "nk-light-0123456789", "admin-key-0123"
SLOTS, LONG = 4, 600


def entry(name: str, key: str) -> str:
    return f'[[keys]]\nname = "{name}"\nkey_sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    from devtools.checkpoints import make_checkpoint

    tmp = tmp_path_factory.mktemp("light")
    checkpoint = make_checkpoint("llama", tmp / "tiny", seed=5, max_position_embeddings=4096)
    keys = tmp / "keys.toml"
    keys.write_text(entry("heavy", HEAVY) + entry("light", LIGHT))
    keys.chmod(0o600)
    server = start_server(tmp, config=f'[[models]]\nmodel = "{checkpoint}"\nid = "tiny"\nmax_model_len = 2100\n'
                                      f'max_slots = {SLOTS}\n[server]\napi_keys_file = "{keys}"\n'
                                      f'admin_api_key = "{ADMIN}"\nlog_format = "json"\n')
    yield server
    server.stop()


def complete(server, key: str, prompt: str, max_tokens: int, rid: str) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(f"{server.base}/completions", json=body, timeout=600,
                   headers={"authorization": f"Bearer {key}", "x-request-id": rid})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def model(server) -> dict:
    return httpx.get(f"{server.url}/models", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10).json()["models"][0]


@pytest.mark.timeout(600)
def test_a_light_key_starts_within_two_seconds_while_another_holds_every_slot(shared):
    prompt = "The heavy key's stream"
    results: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(shared, HEAVY, prompt, LONG,
                                                                                   f"heavy-{i}")))
               for i in range(SLOTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while model(shared)["running"] < SLOTS:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    before = model(shared)["preemptions"]
    t0 = time.monotonic()
    complete(shared, LIGHT, "A short question", 4, "light")
    took = time.monotonic() - t0
    busy = model(shared)["running"]
    for t in threads:
        t.join(600)
    assert took < 2.0, took
    assert busy >= SLOTS - 1, "the heavy streams ended before the light request came: nothing was tested"
    line = next(r for r in json_log(shared) if r.get("request_id") == "light" and r.get("msg") == "request finished")
    assert line["principal"] == "light" and line["queue_s"] < 2.0, line
    assert model(shared)["preemptions"] == before + 1  # one stream gave its slot up, once
    assert len(results) == SLOTS and all(r == results[0] for r in results.values())  # recomputed: the same
