"""The hybrid family from GGUF files laid out as llama.cpp's converter writes them (its
``qwen3next``, ``qwen35`` and ``qwen35moe`` architectures: norms stored as 1 + w, A_log as
-exp(A_log), Qwen3-Next's fused projections split, Qwen3.5's value heads reordered): a float GGUF
of each small random checkpoint gives its safetensors source's logits and greedy tokens, at TP=1
and split over gloo at TP=2; a Q8_0 GGUF stays packed and gives what its dequantized weights give;
and a GGUF is served through the real server."""

from __future__ import annotations

import httpx
import pytest

from conftest import start_server
from test_hybrid import FAMILIES, NEW, PROMPTS, built, job, write_hybrid_checkpoint


def gguf_job(name: str, path, dense: bool = False):
    from devtools.parity import ParityJob

    from neuron.loader.spec import load_spec

    return ParityJob(name, "gguf", [str(path)], load_spec(str(path)).config, PROMPTS, new_tokens=NEW, dense=dense)


ARCH = {"qwen3_next": ("qwen3next", "qwen3_next"), "qwen3_5_text": ("qwen35", "qwen3_5_text"),
        "qwen3_5": ("qwen35", "qwen3_5_text"), "qwen3_5_moe_text": ("qwen35moe", "qwen3_5_moe_text")}


@pytest.mark.timeout(600)
def test_a_float_gguf_of_each_gives_its_safetensors_logits_and_tokens(tmp_path_factory):
    from devtools.gguf_hybrid import write_hybrid_gguf
    from devtools.parity import run_parity

    from neuron.loader.gguf_file import GgufFile

    jobs = []
    for family in sorted(FAMILIES):
        _, ckpt, _ = built(family, tmp_path_factory)
        path = write_hybrid_gguf(ckpt, "F32")
        arch, model_type = ARCH[family]
        assert GgufFile(path, read_tensors=False).fields["general.architecture"] == arch
        g = gguf_job(family + "-gguf", path)
        assert g.config.family == model_type
        jobs += [job(family, ckpt), g]
    results = run_parity(jobs)
    for source, gguf in zip(results[::2], results[1::2]):
        for a, b in zip(source.logits, gguf.logits):
            assert (a - b).abs().max() < 1e-4, gguf.name
        assert source.greedy == gguf.greedy, gguf.name
    # Qwen3.5 (value heads reordered by the converter) and Qwen3-Next (its projections split)
    # over two ranks, each reading its share of the reordered tensors
    split = run_parity([j for j in jobs if j.name in ("qwen3_5-gguf", "qwen3_next-gguf")], world=2, timeout=600)
    for result in split:
        want = next(r for r in results if r.name == result.name)
        assert result.greedy == want.greedy and all((a - b).abs().max() < 1e-4
                                                     for a, b in zip(result.logits, want.logits))


@pytest.mark.usefixtures("float32_activations")
@pytest.mark.timeout(600)
def test_a_q8_0_gguf_stays_packed_and_gives_what_its_dequantized_weights_give(tmp_path):
    """Value heads of 32 (a quant group): the reordered output projection moves whole groups, so it
    too stays packed, split over two ranks."""
    from devtools.gguf_hybrid import write_hybrid_gguf
    from devtools.parity import run_parity

    ckpt = write_hybrid_checkpoint("qwen3_5_moe_text", tmp_path / "wide", seed=5, linear_value_head_dim=32,
                                   linear_key_head_dim=32)
    path = write_hybrid_gguf(ckpt, "Q8_0")
    for world in (1, 2):
        dense, packed = run_parity([gguf_job("dense", path, dense=True), gguf_job("packed", path)], world=world,
                                   timeout=600)
        assert packed.weight_bytes[0] < 0.5 * dense.weight_bytes[0]
        assert packed.greedy == dense.greedy
        assert all((a - b).abs().max() < 1e-4 for a, b in zip(packed.logits, dense.logits))


@pytest.mark.timeout(300)
def test_a_gguf_is_served_as_its_safetensors_are(tmp_path, tmp_path_factory):
    from devtools.gguf_hybrid import write_hybrid_gguf

    _, ckpt, reference = built("qwen3_next", tmp_path_factory)
    path = write_hybrid_gguf(ckpt, "F32")
    server = start_server(tmp_path, config=f'[[models]]\nmodel = "{path}"\nid = "g"\ndtype = "float32"\n'
                                           'max_model_len = 128\nmax_slots = 2\n')
    try:
        for prompt, (_, tokens) in zip(PROMPTS, reference):
            r = httpx.post(f"{server.base}/completions", timeout=120, json={
                "model": "g", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == tokens
        info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        assert info["format"] == "gguf" and info["family"] == "qwen3_next" and info["state_slots"] > 0
    finally:
        assert server.stop() == 0
