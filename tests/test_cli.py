"""``neuron models | load | unload | status | chat`` against a live daemon, as subprocesses, with
keys from flags and from the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from conftest import DEFAULT_MODEL, OPS_ADMIN_KEY, OPS_API_KEY, ROOT, json_log, ops_headers


def neuron(*args: str, env: dict | None = None, stdin: str | None = None, timeout: float = 300) \
        -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_")}
    return subprocess.run([sys.executable, "-m", "neuron.cli", *args], cwd=ROOT, env={**clean, **(env or {})},
                          input=stdin, capture_output=True, text=True, timeout=timeout)


KEYS = {"NEURON_API_KEY": OPS_API_KEY, "NEURON_ADMIN_API_KEY": OPS_ADMIN_KEY}


def test_neuron_help_lists_every_sub_command():
    out = neuron("--help")
    assert out.returncode == 0
    for command in ("serve", "models", "load", "unload", "status", "chat"):
        assert f"    {command} " in out.stdout, command


def test_models_and_status_read_the_daemon_with_keys_from_the_environment(ops):
    out = neuron("models", "--url", ops.url, env=KEYS)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert header.split() == ["ID", "STATUS", "TP", "DEVICES", "DTYPE", "MAX_LEN", "RUNNING", "WAITING"]
    assert row.split() == [DEFAULT_MODEL, "loaded", "1", "cpu", "float32", "1024", "0", "0"]
    status = neuron("status", "--url", ops.url, "--json", env=KEYS)
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert {k: data["health"][k] for k in ("status", "models")} == {"status": "ok", "models": {DEFAULT_MODEL: "loaded"}}
    assert [m["id"] for m in data["models"]] == [DEFAULT_MODEL]
    assert data["health"]["devices"][DEFAULT_MODEL][0]["device"] == "cpu" and data["version"]["version"]
    assert set(data["usage"]) <= {"default"}  # the one api_key's principal, and nobody else


def test_a_wrong_key_or_no_daemon_is_one_clear_line_and_exit_1(ops):
    out = neuron("models", "--url", ops.url, "--admin-key", "wrong")
    assert out.returncode == 1 and out.stderr.strip() == "neuron: 401 invalid_api_key: missing or invalid API key"
    gone = neuron("status", "--url", "http://127.0.0.1:9")
    assert gone.returncode == 1 and "cannot reach http://127.0.0.1:9" in gone.stderr


def test_load_and_unload_a_model_from_a_root_with_the_cli(ops):
    flags = ("--url", ops.url, "--api-key", OPS_API_KEY, "--admin-key", OPS_ADMIN_KEY)
    out = neuron("load", "tiny-llama", "--id", "cli-tiny", "--max-model-len", "64", "--max-slots", "1", *flags)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("loaded cli-tiny in ") and "max_model_len 64" in out.stdout
    try:
        listed = json.loads(neuron("models", "--json", *flags).stdout)["models"]
        assert {m["id"]: m["status"] for m in listed} == {DEFAULT_MODEL: "loaded", "cli-tiny": "loaded"}
        r = httpx.post(f"{ops.base}/completions", headers=ops_headers(), timeout=60,
                       json={"model": "cli-tiny", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        gone = neuron("unload", "cli-tiny", *flags)
    assert gone.returncode == 0 and gone.stdout.strip() == "unloaded cli-tiny"
    assert [m["id"] for m in json.loads(neuron("models", "--json", *flags).stdout)["models"]] == [DEFAULT_MODEL]
    refused = neuron("load", "/etc", *flags)
    assert refused.returncode == 1 and "404 model_not_found" in refused.stderr


def test_chat_streams_answers_and_keeps_the_conversation_through_a_pipe(ops):
    turns = ["What is the capital of France?", "And what is the capital of Italy?"]
    seen = len(json_log(ops))
    out = neuron("chat", "--url", ops.url, "--temperature", "0", "--max-tokens", "24", env=KEYS,
                 stdin="\n".join(turns) + "\n\n/exit\nnever sent\n")
    assert out.returncode == 0, out.stderr
    answers = out.stdout.splitlines()
    assert len(answers) == 2 and "Paris" in answers[0] and "Rome" in answers[1]
    started = [line for line in json_log(ops)[seen:] if line["msg"] == "request started"]
    assert [line["stream"] for line in started] == [True, True]  # "never sent" was not sent
    # The second turn carried the whole conversation: its prompt is exactly these messages.
    history = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": answers[0]},
               {"role": "user", "content": turns[1]}]
    tok = httpx.post(f"{ops.url}/tokenize", json={"model": DEFAULT_MODEL, "messages": history},
                     headers=ops_headers(), timeout=30).json()
    assert started[1]["prompt_tokens"] == tok["count"]


def test_chat_reports_a_refused_turn_and_exits_1(ops):
    out = neuron("chat", "--url", ops.url, "--model", "absent", env=KEYS, stdin="hello\n")
    assert out.returncode == 1 and "404 model_not_found" in out.stderr and out.stdout.strip() == ""
