"""Quantized weights through the real server: `neuron serve --quantize q8_0` with the default
SmolLM2 GGUF (kept in its own blocks) and a float checkpoint (quantized at load), a run-time load
with ``"quant": "q4"`` at TP=2; GET /models reports each model's weight format and resident bytes
per rank, and greedy completions equal the float32 model of the same dequantized weights."""

from __future__ import annotations

import httpx
import pytest
import torch

from conftest import start_server
from neuron.loader.resolve import DEFAULT_MODEL, default_model_path
from neuron.loader.spec import load_spec
from devtools.checkpoints import make_checkpoint
from devtools.parity import ParityJob, run_parity

NEW_TOKENS = 24
_gen = torch.Generator().manual_seed(77)
PROMPTS = [torch.randint(0, 509, (n,), generator=_gen).tolist() for n in (6, 19, 33)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("quant-served") / "qwen3", seed=41)


@pytest.fixture(scope="module")
def server(float32_activations, tmp_path_factory, checkpoint):
    config = (f'[[models]]\nmodel = "{DEFAULT_MODEL}"\nmax_model_len = 256\nmax_slots = 2\n'
              f'[[models]]\nmodel = "{checkpoint}"\nid = "qwen3-q8"\nmax_model_len = 128\nmax_slots = 2\n')
    server = start_server(tmp_path_factory.mktemp("server"), config=config, args=["--quantize", "q8_0"])
    yield server
    assert server.stop() == 0


def models(server) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{server.url}/models", timeout=10).json()["models"]}


def complete(server, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(f"{server.base}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def reference(fmt: str, paths: list[str], quant: str | None, prompts: list[list[int]]) -> list[list[int]]:
    cfg = load_spec(paths[0] if fmt == "gguf" else str(__import__("pathlib").Path(paths[0]).parent)).config
    (r,) = run_parity([ParityJob("ref", fmt, paths, cfg, prompts, NEW_TOKENS, quant=quant, dense=True)])
    return r.greedy


def test_models_reports_the_gguf_kept_packed_and_its_bytes(server):
    m = models(server)[DEFAULT_MODEL]
    size = default_model_path().stat().st_size
    assert m["weight_format"].startswith("gguf:Q4_1+Q8_0") and m["dtype"] == "float32"
    assert "int4 from Q4_1 x120" in m["packing"] and "int8 from Q8_0 x1" in m["packing"]
    (held,) = m["shard_bytes"]
    print(f"SmolLM2: {held} bytes resident for a {size}-byte file ({held / size:.3f}x)")
    assert 0.9 * size <= held <= 1.15 * size


def test_a_float_checkpoint_is_quantized_at_load_by_the_cli_flag(server, checkpoint):
    m = models(server)["qwen3-q8"]
    assert m["weight_format"] == "q8_0 (in situ from safetensors:f32)"
    assert "int8 from q8_0 (in situ)" in m["packing"] and "dense" not in m["packing"]
    dense = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    assert m["shard_bytes"][0] < 0.4 * dense  # 9 bits a weight where the file has 32


def test_greedy_completions_equal_the_float32_reference_of_the_same_weights(server, checkpoint):
    smol = str(default_model_path())
    tk = load_spec(smol).tokenizer.tokenizer
    texts = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time"]
    prompts = [tk.encode(t, add_special_tokens=False).ids for t in texts]
    assert [complete(server, DEFAULT_MODEL, p) for p in prompts] == reference("gguf", [smol], None, prompts)
    paths = [str(p) for p in sorted(checkpoint.glob("*.safetensors"))]
    want = reference("safetensors", paths, "q8_0", PROMPTS)
    assert [complete(server, "qwen3-q8", p) for p in PROMPTS] == want
    assert len({tuple(t) for t in want}) > 1


def test_a_run_time_load_quantizes_to_q4_at_tp2(server, checkpoint):
    body = {"model": str(checkpoint), "id": "qwen3-q4-tp2", "tensor_parallel": 2, "quant": "q4",
            "max_model_len": 128, "max_slots": 2}
    r = httpx.post(f"{server.url}/models/load", json=body, timeout=300)
    assert r.status_code == 200, r.text
    m = models(server)["qwen3-q4-tp2"]
    assert m["weight_format"] == "q4 (in situ from safetensors:f32)" and len(m["shard_bytes"]) == 2
    alone = models(server)["qwen3-q8"]["shard_bytes"][0]
    assert all(b < 0.45 * alone for b in m["shard_bytes"])  # half the model in 5 bits instead of 9
    paths = [str(p) for p in sorted(checkpoint.glob("*.safetensors"))]
    assert [complete(server, "qwen3-q4-tp2", p) for p in PROMPTS] == reference("safetensors", paths, "q4", PROMPTS)
    r = httpx.post(f"{server.url}/models/load", json=body | {"id": "bad", "quant": "q3"}, timeout=60)
    assert r.status_code == 400 and "q8_0 or q4" in r.json()["error"]["message"]
