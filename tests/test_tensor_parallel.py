"""The default model split over 2 and 3 rank processes (gloo) answers exactly as at TP=1, and
each rank holds only its share of the sharded weights."""

from __future__ import annotations

import httpx
import pytest

from conftest import SMALL, greedy_ids, start_server

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three fruits.",
           "Explain gravity in one sentence."]


def greedy(server, prompt: str) -> list[int]:
    return greedy_ids(server, prompt, 32)


def describe(server) -> dict:
    return httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]


@pytest.fixture(scope="module")
def reference(tp1):
    return [greedy(tp1, q) for q in PROMPTS], describe(tp1)


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_gives_the_same_greedy_tokens_and_splits_the_weights(server_tmp, reference, world):
    tokens, single = reference
    server = start_server(server_tmp, config=SMALL, args=["--tensor-parallel", str(world)])
    try:
        assert [greedy(server, q) for q in PROMPTS] == tokens
        info = describe(server)
        assert info["tensor_parallel"] == world and len(set(info["pids"])) == world
        assert len(server.rank_pids()) == world
        whole = single["shard_bytes"][0]
        shares = info["shard_bytes"]
        # Norms are replicated (about 0.03% here) and the vocab is padded to equal shares.
        assert sum(shares) == pytest.approx(whole, rel=0.01)
        # 3 KV-head groups: 2+1 over two ranks, 1+1+1 over three; the MLP and vocab split evenly.
        assert max(shares) < whole * (0.55 if world == 2 else 0.36)
        assert min(shares) > whole * (0.45 if world == 2 else 0.31)
    finally:
        assert server.stop() == 0
