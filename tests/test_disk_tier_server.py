"""The prefix cache's disk tier through real servers (CPU, the default model): a prompt's blocks
go through the host tier to disk while the daemon idles; a daemon restarted with the same model
finds them there, and the prompt comes back from disk with its cold answer (TP=1, and TP=2 with
each rank its own files); `GET /models`, `/metrics` and the log line count it. Damaged files are
never served: the request that wanted them starts again and answers as it did cold."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from conftest import DEFAULT_MODEL, json_log, start_server
from test_host_tier_server import long_prompt

TOPIC = "the history of the bicycle in northern towns"


def config(disk: Path, tp: int = 1) -> str:
    return (f'[server]\nlog_format = "json"\n\n[cache]\nhost_gb = 0.12\ndisk_dir = "{disk}"\ndisk_gb = 1.0\n\n'
            f'[[models]]\nmodel = "{DEFAULT_MODEL}"\nmax_model_len = 768\nkv_cache_tokens = 1024\nmax_slots = 2\n'
            f'tensor_parallel = {tp}\n')


def ask(server) -> dict:
    r = httpx.post(f"{server.base}/chat/completions", timeout=300, json={
        "model": DEFAULT_MODEL, "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": long_prompt(TOPIC)}], "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def files(disk: Path, rank: int) -> list[Path]:
    return sorted((disk / DEFAULT_MODEL / f"rank{rank}").glob("*.kv"))


def written(disk: Path, tp: int, blocks: int, timeout: float = 60) -> None:
    """Until every rank has ``blocks`` files at least: the idle daemon writes its cache out."""
    deadline = time.monotonic() + timeout
    while any(len(files(disk, r)) < blocks for r in range(tp)):
        assert time.monotonic() < deadline, [len(files(disk, r)) for r in range(tp)]
        time.sleep(0.1)


def disk_tier(server) -> dict:
    return httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]["prefix_cache_tiers"]["disk"]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_restarted_daemon_answers_a_prompt_from_the_disk_tier_as_it_did_cold(tmp_path, tp):
    disk = tmp_path / "kv"
    first = start_server(tmp_path, config=config(disk, tp))
    try:
        cold = ask(first)
        full = cold["usage"]["prompt_tokens"] // 16
        written(disk, tp, full)
        assert disk_tier(first)["written"] >= full
    finally:
        first.stop()
    assert oct(os.stat(disk).st_mode & 0o777) == "0o700"
    again = start_server(tmp_path, config=config(disk, tp))
    try:
        warm = ask(again)
        assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= warm["usage"]["prompt_tokens"] - 16 - 15
        tier = disk_tier(again)
        assert tier["hits"] == cached and tier["read"] == cached // 16 and tier["used"] >= full
        line = [r for r in json_log(again) if r.get("msg") == "request finished"][-1]
        assert line["cached_tokens"] == cached and line["cached_host_tokens"] == cached
        assert line["cached_disk_tokens"] == cached
        metrics = httpx.get(f"{again.url}/metrics", timeout=10).text
        assert 'neuron:prefix_cache_tier_hits_total{model_name="%s",tier="disk"} %d.0' % (DEFAULT_MODEL, cached) \
            in metrics
    finally:
        again.stop()


def test_damaged_block_files_are_never_served_and_the_answer_stays_the_cold_one(tmp_path):
    disk = tmp_path / "kv"
    first = start_server(tmp_path, config=config(disk))
    try:
        cold = ask(first)
        written(disk, 1, cold["usage"]["prompt_tokens"] // 16)
    finally:
        first.stop()
    damaged = {}
    for f in files(disk, 0)[::2]:
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
        damaged[f] = bytes(raw)
    again = start_server(tmp_path, config=config(disk))
    try:
        warm = ask(again)
        assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
        # read, found damaged, deleted (and written again once recomputed); the rest never read
        assert any(not f.exists() or f.read_bytes() != raw for f, raw in damaged.items())
        assert "fails its checksum: deleted, not served" in again.log()
        assert disk_tier(again)["read"] < cold["usage"]["prompt_tokens"] // 16
    finally:
        again.stop()


def test_a_disk_tier_smaller_than_a_block_is_named_at_load_and_serving_goes_on(tmp_path):
    disk = tmp_path / "kv"
    server = start_server(tmp_path, config=config(disk).replace("disk_gb = 1.0", "disk_gb = 0.0001"))
    try:
        assert ask(server)["usage"]["completion_tokens"] > 0
        assert "no disk tier: cache.disk_gb 0.0001 holds less than one KV block a rank" in server.log()
        info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]["prefix_cache_tiers"]
        assert "disk" not in info and info["host"]["blocks"] > 0
    finally:
        server.stop()
