"""The prefix cache's host and disk tiers for a hybrid model (Gated DeltaNet layers keep a recurrent
state), through real servers on a small random Qwen3.5 checkpoint on the CPU: the ranks' few
snapshot slots and small KV cache give up a prompt's snapshots and blocks to the host tier, and
the prompt coming back restarts from there (its state restored into its own slot, its blocks
into the ranks' cache) with the answer it had cold (TP=1, and TP=2 with each rank its share of
both); a restarted daemon finds both on disk. `GET /models` counts the snapshots moved."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from conftest import start_server
from test_gpu import needs_gpu
from test_hybrid_prefix_cache import complete, models, words

BLOCK = 16


def config(ckpt: Path, tp: int = 1, disk: Path | None = None) -> str:
    # Two snapshot slots, 16 KV blocks: three prompts of 100 tokens do not stay in the ranks.
    return (f'[[models]]\nmodel = "{ckpt}"\nid = "hybrid"\ndtype = "float32"\nmax_model_len = 256\nmax_slots = 2\n'
            f'block_size = {BLOCK}\nprefix_caching = true\nstate_snapshots = 2\nstate_snapshot_interval = 64\n'
            f'kv_cache_tokens = 256\ntensor_parallel = {tp}\n[engine]\nprefill_chunk = 48\n'
            '[cache]\nhost_gb = 0.05\n' + (f'disk_dir = "{disk}"\ndisk_gb = 0.5\n' if disk else ''))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_hybrid import built

    return built("qwen3_5_text", tmp_path_factory)[1]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_prompt_whose_snapshots_left_the_ranks_restarts_from_the_host_tier_with_its_cold_answer(
        ckpt, tmp_path, tp):
    server = start_server(tmp_path, config=config(ckpt, tp))
    try:
        rng = random.Random(7)
        prompts = [words(rng, 100) for _ in range(4)]
        cold = [complete(server, p) for p in prompts]
        assert all(cached == 0 for _, cached in cold)
        tier = models(server)["prefix_cache_tiers"]["host"]
        assert tier["snapshots_offloaded"] >= 2 and len(tier["bytes"]) == tp
        again, cached = complete(server, prompts[0])
        assert again == cold[0][0]
        assert cached == 96  # every full block before the last token: state and K/V from the tier
        after = models(server)["prefix_cache_tiers"]["host"]
        assert after["snapshots_restored"] > tier["snapshots_restored"] and after["restored"] > tier["restored"]
        assert "a state snapshot takes" in server.log()
    finally:
        server.stop()


@pytest.mark.parametrize("device,tp", [("cpu", 1), ("cpu", 2), pytest.param("cuda", 1, marks=[pytest.mark.gpu, needs_gpu])])
def test_a_chat_s_next_turn_restarts_at_the_end_of_the_last_answer_from_the_host_tier(ckpt, tmp_path, device, tp):
    """An end-of-answer snapshot and the partial block it hangs on go down to the host tier as
    the ranks evict them: the next turn (the whole last turn and a question) restarts at the very
    end of the last answer, not at its prompt's last full block, and answers as no cache does.
    At TP=2 each rank moves its own share; on a GPU, through the tier's page-locked slots."""
    rng = random.Random(11)
    prompt, others, question = words(rng, 100), [words(rng, 100) for _ in range(3)], words(rng, 20)
    args = ["--device", device]
    on = start_server(tmp_path, config=config(ckpt, tp), args=args)
    try:
        answer, _ = complete(on, prompt, 10)
        for other in others:  # the ranks' two snapshot slots and 16 blocks go to these
            complete(on, other)
        before = models(on)["prefix_cache_tiers"]["host"]
        turn = prompt + answer + question
        got, cached = complete(on, turn, 8)
        after = models(on)["prefix_cache_tiers"]["host"]
    finally:
        on.stop()
    assert cached == 100 + 10 - 1  # every token whose K/V the last turn computed: 6 blocks and 13 more
    assert after["snapshots_restored"] == before["snapshots_restored"] + 1
    off = start_server(tmp_path, config=config(ckpt).replace("prefix_caching = true", "prefix_caching = false")
                       .replace("[cache]\nhost_gb = 0.05\n", ""), args=args)
    try:
        assert got == complete(off, turn, 8)[0]
    finally:
        off.stop()


def test_a_restarted_daemon_restarts_a_hybrid_prompt_from_the_disk_tier(ckpt, tmp_path):
    disk = tmp_path / "kv"
    prompt = words(random.Random(8), 100)
    first = start_server(tmp_path, config=config(ckpt, disk=disk))
    try:
        cold, cached = complete(first, prompt)
        assert cached == 0
        deadline = time.monotonic() + 60
        while models(first)["prefix_cache_tiers"]["disk"]["written"] < 6 + 2:  # its blocks and a snapshot
            assert time.monotonic() < deadline, models(first)["prefix_cache_tiers"]
            time.sleep(0.1)
    finally:
        first.stop()
    again = start_server(tmp_path, config=config(ckpt, disk=disk))
    try:
        warm, cached = complete(again, prompt)
        assert warm == cold and cached == 96
        tiers = models(again)["prefix_cache_tiers"]
        assert tiers["disk"]["read"] >= 6 and tiers["host"]["snapshots_restored"] == 1
    finally:
        again.stop()


def test_a_restarted_daemon_resumes_a_chat_at_the_end_of_its_last_answer_from_the_disk_tier(ckpt, tmp_path):
    """An idle daemon copies its end-of-answer snapshot down with its partial block, as it does its
    blocks and boundary snapshots, so the next turn after a restart starts at the answer's end."""
    disk, rng = tmp_path / "kv", random.Random(12)
    prompt, question = words(rng, 100), words(rng, 20)
    first = start_server(tmp_path, config=config(ckpt, disk=disk))
    try:
        answer, _ = complete(first, prompt, 10)
        written, deadline = -1, time.monotonic() + 60
        while written != (written := models(first)["prefix_cache_tiers"]["disk"]["written"]) or written < 8:
            assert time.monotonic() < deadline, models(first)["prefix_cache_tiers"]
            time.sleep(0.5)  # until the idle daemon has written all it will
    finally:
        first.stop()
    turn = prompt + answer + question
    again = start_server(tmp_path, config=config(ckpt, disk=disk))
    try:
        got, cached = complete(again, turn, 8)
        disk = models(again)["prefix_cache_tiers"]["disk"]
    finally:
        again.stop()
    assert cached == 100 + 10 - 1 and disk["hits"] == cached  # all of it read from disk
    off = start_server(tmp_path, config=config(ckpt).replace("prefix_caching = true", "prefix_caching = false")
                       .replace("[cache]\nhost_gb = 0.05\n", ""))
    try:
        assert got == complete(off, turn, 8)[0]
    finally:
        off.stop()


def test_concurrent_requests_through_small_tiers_answer_as_no_cache_does(ckpt, tmp_path):
    """Six clients, four slots, two snapshot slots a 32-token interval apart and a 384-token rank
    cache: snapshots and blocks go down and come back while other sequences run beside them, three
    times over, and every answer is the cache-off server's."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def served(caching: bool) -> str:
        return (f'[[models]]\nmodel = "{ckpt}"\nid = "hybrid"\ndtype = "float32"\nmax_model_len = 256\n'
                f'max_slots = 4\nblock_size = {BLOCK}\nprefix_caching = {str(caching).lower()}\nstate_snapshots = 2\n'
                'state_snapshot_interval = 32\nkv_cache_tokens = 384\n[engine]\nprefill_chunk = 48\n'
                + ('[cache]\nhost_gb = 0.01\n' if caching else ''))

    rng = random.Random(3)
    shared = [words(rng, rng.randrange(20, 90)) for _ in range(3)]
    jobs = [shared[rng.randrange(3)] + words(rng, rng.randrange(0, 40)) for _ in range(40)]

    def answers(server) -> list[tuple[list[int], int]]:
        with ThreadPoolExecutor(6) as pool:
            return list(pool.map(lambda p: complete(server, p, 8), jobs))

    off = start_server(tmp_path, config=served(False))
    try:
        reference = [tokens for tokens, _ in answers(off)]
    finally:
        off.stop()
    on = start_server(tmp_path, config=served(True))
    try:
        for _ in range(3):
            got = answers(on)
            assert [tokens for tokens, _ in got] == reference
        host = httpx.get(f"{on.url}/models", timeout=10).json()["models"][0]["prefix_cache_tiers"]["host"]
        assert host["snapshots_restored"] > 10 and host["snapshots_offloaded"] > 10
    finally:
        on.stop()
