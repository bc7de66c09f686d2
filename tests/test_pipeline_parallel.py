"""Pipeline parallelism on one host (gloo): the default model's layers split into stages, alone
(PP=2, PP=3) and with tensor parallelism inside each stage (TP=2 x PP=2), answers exactly as
TP=1, one request at a time and 8 at once; each stage holds only its layers' weights and K/V."""

from __future__ import annotations

import httpx
import pytest

from conftest import SMALL, concurrent_greedy_ids, greedy_ids, start_server

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three fruits.",
           "Explain gravity in one sentence."]


def greedy(server, prompt: str) -> list[int]:
    return greedy_ids(server, prompt, 24)


def concurrently(server, n: int = 8) -> list[list[int]]:
    return concurrent_greedy_ids(server, [PROMPTS[i % len(PROMPTS)] for i in range(n)], 24)


@pytest.fixture(scope="module")
def reference(tp1):
    info = httpx.get(f"{tp1.url}/models", timeout=10).json()["models"][0]
    return [greedy(tp1, q) for q in PROMPTS], info


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 3)])
def test_pipeline_stages_answer_as_one_rank(server_tmp, reference, tp, pp):
    tokens, single = reference
    server = start_server(server_tmp, config=SMALL, args=["--tensor-parallel", str(tp), "--pipeline-parallel", str(pp)])
    try:
        assert [greedy(server, q) for q in PROMPTS] == tokens
        assert concurrently(server) == [tokens[i % len(PROMPTS)] for i in range(8)]
        info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        assert (info["tensor_parallel"], info["pipeline_parallel"]) == (tp, pp)
        assert len(info["shard_bytes"]) == tp * pp == len(server.rank_pids())
        # A stage holds its layers (and the tied embedding where it starts or ends the model):
        # with 3 stages the middle one holds a third of the layers and no embedding.
        if pp == 3:
            assert info["shard_bytes"][1] < 0.3 * single["shard_bytes"][0]
    finally:
        assert server.stop() == 0


def test_a_family_without_stages_is_refused_by_name(server_tmp, tmp_path):
    from test_hybrid import write_hybrid_checkpoint

    model = write_hybrid_checkpoint("qwen3_5_text", tmp_path / "hybrid")
    server = start_server(server_tmp, config=f'[[models]]\nmodel = "{model}"\nmax_model_len = 256\nmax_slots = 2\n',
                          args=["--pipeline-parallel", "2"], healthy=False)
    try:
        server.proc.wait(120)
        assert "has no pipeline-parallel split yet" in server.log()
    finally:
        server.stop()
