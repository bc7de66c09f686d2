"""Several users on one daemon, against a real server: named keys from a keys file, one key's 32
streams and waiting requests do not hold up another key's request (admitted at the next step),
per-key caps answer 429 to that key only, a SIGHUP reload adds and removes keys while requests run,
usage per key in /metrics and the logs, /version and the device telemetry of /health and /metrics,
and `neuron status` showing them."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

import neuron
from conftest import ROOT, json_log, start_server
from neuron.server.keys import KeyRing, Principal, add_key

ALICE, BOB, CAROL = "nk-alice-0123456789", "nk-bob-0123456789", "nk-carol-0123456789"
MODEL = "tiny"


def entry(name: str, key: str, **extra) -> str:
    lines = [f'name = "{name}"', f'key_sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"']
    lines += [f"{k} = {v}" for k, v in extra.items()]
    return "[[keys]]\n" + "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def keyed(server_tmp):
    from devtools.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", server_tmp / "tiny-keyed", seed=3, max_position_embeddings=8192)
    keys = server_tmp / "keys.toml"
    keys.write_text(entry("alice", ALICE, max_running=32, max_waiting=4, gateway="true") + entry("bob", BOB))
    keys.chmod(0o600)  # a keys file others can read is refused
    config = f"""
[[models]]
model = "{checkpoint}"
id = "{MODEL}"
max_model_len = 8192
max_slots = 34

[engine]
queue_size = 64

[server]
api_keys_file = "{keys}"
admin_api_key = "admin-key"
log_format = "json"
principal_header = "x-account-id"
"""
    server = start_server(server_tmp, config=config)
    server.keys = keys
    yield server
    server.stop()


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ask(server, key: str, max_tokens: int = 4, rid: str | None = None) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The lighthouse keeper", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    return httpx.post(f"{server.base}/completions", json=body, timeout=300,
                      headers={**headers(key), **({"x-request-id": rid} if rid else {})})


def finish_line(server, rid: str) -> dict:
    return next(r for r in json_log(server) if r.get("request_id") == rid and r.get("msg") == "request finished")


def describe(server) -> dict:
    return httpx.get(f"{server.url}/models", headers=headers("admin-key"), timeout=10).json()["models"][0]


def test_one_keys_streams_and_queue_do_not_hold_up_another_keys_request(keyed):
    # Her streams run until the test hangs up: nothing here depends on how fast the machine is.
    stop = threading.Event()
    streams: list[tuple[int, int]] = []  # (status, data lines read)

    def stream() -> None:
        # Long enough that all 32 start while the first still run, however busy the machine:
        # 1,900 tokens of the tiny model ended before the last of them began, twice in full runs.
        body = {"model": MODEL, "prompt": "The lighthouse keeper", "max_tokens": 8000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{keyed.base}/completions", json=body, headers=headers(ALICE), timeout=300) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data: {")
                if stop.is_set() and lines:
                    break
            streams.append((r.status_code, lines))

    def start(n: int, running: int, waiting: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=stream) for _ in range(n)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while (now := describe(keyed))["running"] != running or now["waiting"] != waiting:
            assert time.monotonic() < deadline, ({k: now[k] for k in ("running", "waiting")}, streams[:2])
            time.sleep(0.02)
        return threads

    alice = start(32, 32, 0)
    alice += start(4, 32, 4)  # her cap holds these back
    refused = ask(keyed, ALICE)  # her fifth waiting request: over her max_waiting
    assert refused.status_code == 429 and "alice" in refused.json()["error"]["message"]
    assert int(refused.headers["Retry-After"]) >= 1
    bob = ask(keyed, BOB, rid="bob-first")  # bob is not capped, and not queued behind her
    assert bob.status_code == 200, bob.text
    step_ms = describe(keyed)["step_ms"]
    line = finish_line(keyed, "bob-first")
    assert line["principal"] == "bob" and line["queue_s"] * 1e3 <= max(3 * step_ms, 50), (line, step_ms)
    assert (describe(keyed)["running"], describe(keyed)["waiting"]) == (32, 4)  # hers go on meanwhile
    stop.set()  # her 32 hang up; her 4 then run, stream, and hang up too
    for t in alice:
        t.join(120)
    assert [s for s, n in streams if s != 200 or n < 1] == [], streams
    assert len(streams) == 36
    deadline = time.monotonic() + 60
    while (now := describe(keyed))["running"] or now["waiting"]:
        assert time.monotonic() < deadline, now
        time.sleep(0.1)
    metrics = httpx.get(f"{keyed.url}/metrics", headers=headers("admin-key"), timeout=10).text
    assert 'neuron:principal_requests_total{principal="alice"} 36.0' in metrics
    assert 'neuron:principal_rejections_total{code="rate_limit_exceeded",principal="alice"} 1.0' in metrics
    assert 'neuron:principal_generation_tokens_total{principal="bob"} 4.0' in metrics


def test_a_reload_adds_and_removes_keys_while_requests_run(keyed):
    running: list[httpx.Response] = []
    t = threading.Thread(target=lambda: running.append(ask(keyed, BOB, max_tokens=200)))
    t.start()
    time.sleep(0.5)
    assert ask(keyed, CAROL).status_code == 401
    keyed.keys.write_text(entry("alice", ALICE, max_running=32, max_waiting=4, gateway="true") + entry("carol", CAROL))
    keyed.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while ask(keyed, CAROL).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert ask(keyed, BOB).status_code == 401  # removed: refused at once
    t.join(120)
    assert running[0].status_code == 200 and running[0].json()["usage"]["completion_tokens"] == 200
    keyed.keys.write_text("[[keys]]\nname = 'broken'\n")  # a broken file keeps the keys as they were
    keyed.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "keys file not reloaded, the keys stay as they were" not in keyed.log():  # the reload ran
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert ask(keyed, CAROL).status_code == 200 and keyed.proc.poll() is None


def test_a_gateways_header_names_the_principal(keyed):
    r = httpx.post(f"{keyed.base}/completions", timeout=60, headers={**headers(ALICE), "x-account-id": "acct-7",
                                                                     "x-request-id": "via-gateway"},
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert finish_line(keyed, "via-gateway")["principal"] == "acct-7"


def test_version_telemetry_and_status(keyed):
    version = httpx.get(f"{keyed.url}/version", timeout=10).json()
    assert version["version"] == neuron.__version__ and version["python"]
    model = version["models"][MODEL]
    assert model["torch"] and model["cpu_isa"] and model["devices"] == ["cpu"]
    health = httpx.get(f"{keyed.url}/health", timeout=10).json()
    (rank,) = health["devices"][MODEL]
    assert rank["device"] == "cpu" and 0 < rank["memory_used"] < rank["memory_total"]
    assert rank["cpu_isa"] == model["cpu_isa"] and rank["threads"] >= 1 and 0 <= rank["utilization"] <= 100
    metrics = httpx.get(f"{keyed.url}/metrics", headers=headers("admin-key"), timeout=10).text
    assert f'neuron:cpu_threads{{cpu_isa="{rank["cpu_isa"]}",model_name="{MODEL}",rank="0"}}' in metrics
    assert "neuron:device_memory_total_bytes{" in metrics
    out = subprocess.run([sys.executable, "-m", "neuron.cli", "status", "--url", keyed.url, "--admin-key",
                          "admin-key"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{MODEL} rank 0 on cpu" in out.stdout and "usage by key:" in out.stdout and "alice: requests" in out.stdout


def test_a_wrong_key_takes_as_long_to_refuse_as_a_right_one_to_pass(tmp_path):
    path = tmp_path / "keys.toml"
    keys = [add_key(str(path), f"user{i}") for i in range(63)]
    made = subprocess.run([sys.executable, "-m", "neuron.cli", "keys", "add", "user63", "--file", str(path),
                           "--max-running", "4", "--weight", "2"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert made.returncode == 0 and "user63" in made.stderr, made.stderr
    keys.append(made.stdout.strip())
    ring = KeyRing("", str(path))

    def timed(key: str) -> float:
        t0 = time.perf_counter()
        for _ in range(200):
            ring.check(key)
        return time.perf_counter() - t0

    assert ring.check(keys[0]).name == "user0" and ring.check(keys[-1]) == Principal("user63", 4, 0, 2.0)
    assert ring.check("nk-wrong") is None and ring.check("") is None
    # The three keys' runs interleaved, each key's fastest of 15: a pause of the machine's (a
    # busy neighbour) slows one run, not one key.
    probes = (keys[0], keys[-1], "nk-" + "x" * 43)
    runs = [[timed(key) for key in probes] for _ in range(15)]
    first, last, wrong = (min(run[i] for run in runs) for i in range(3))
    assert max(first, last, wrong) < 1.5 * min(first, last, wrong), (first, last, wrong)
    assert path.stat().st_mode & 0o077 == 0  # the file is its owner's alone
