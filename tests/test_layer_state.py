"""Per-layer state through the family seam: a throwaway family (tests/toy_family.py) with one
attention layer and one layer that keeps a fixed-size state per sequence, served by the real
server with continuous batching and preemption. Its state slots are allocated, kept apart per
sequence (8 concurrent requests get what each gets alone, and what a plain full-sequence forward
gives) and freed."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from conftest import start_server
from devtools.fixture_tokenizer import BOS_TOKEN, EOS_TOKEN, build_tokenizer, write_tokenizer

TESTS = Path(__file__).resolve().parent
TOY_ENV = {"NEURON_FAMILIES": "toy_family",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((9, 20, 17, 14, 5, 12, 3, 19))]
NEW = 40


def write_toy_checkpoint(out: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    H, inter, layers = 64, 128, ["attention", "recurrent"]
    config = {"model_type": "toy_recurrent", "architectures": ["ToyRecurrent"], "vocab_size": tokenizer.get_vocab_size(),
              "hidden_size": H, "intermediate_size": inter, "num_attention_heads": 4, "layer_types": layers,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
              "bos_token_id": tokenizer.token_to_id(BOS_TOKEN), "eos_token_id": tokenizer.token_to_id(EOS_TOKEN)}
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    w = {"model.embed_tokens.weight": rand(config["vocab_size"], H, scale=0.5), "model.norm.weight": 1 + rand(H)}
    for i, kind in enumerate(layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + rand(H), p + "post_attention_layernorm.weight": 1 + rand(H),
              p + "mlp.gate_proj.weight": rand(inter, H), p + "mlp.up_proj.weight": rand(inter, H),
              p + "mlp.down_proj.weight": rand(H, inter)}
        if kind == "attention":
            w |= {p + f"self_attn.{x}_proj.weight": rand(H, H, scale=0.2) for x in "qkvo"}
        else:
            w |= {p + "mixer.in_proj.weight": rand(H, H, scale=0.2), p + "mixer.out_proj.weight": rand(H, H, scale=0.3),
                  p + "mixer.decay": rand(H, scale=2.0) + 2.0}
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    write_tokenizer(out, tokenizer, config)
    return out


def reference_tokens(ckpt: Path, prompt: list[int], n: int) -> list[int]:
    import toy_family
    from safetensors.torch import load_file
    from toy_model import reference_logits

    raw = json.loads((ckpt / "config.json").read_text())
    cfg = toy_family.config_from_hf(raw, raw)
    w = load_file(str(ckpt / "model.safetensors"))
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(reference_logits(w, cfg, ids).argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    ckpt = write_toy_checkpoint(tmp_path_factory.mktemp("toy-ckpt"))
    # Four slots for eight requests; 16 blocks of 8 tokens hold two of them at full length, so
    # running ones are preempted; prompts go in chunks of 16 tokens.
    config = (f'[[models]]\nmodel = "{ckpt}"\nid = "toy"\ndtype = "float32"\nmax_model_len = 64\nmax_slots = 4\n'
              f'block_size = 8\nkv_cache_tokens = 128\n[engine]\nprefill_chunk = 16\nmax_queue_wait_s = 600\n')
    server = start_server(tmp_path_factory.mktemp("toy"), config=config, env=TOY_ENV)
    yield server, ckpt
    server.stop()


def complete(server, prompt: list[int] | list[list[int]]) -> list[int] | list[list[int]]:
    """Greedy tokens of a prompt, or of each prompt of a batch."""
    r = httpx.post(f"{server.base}/completions", timeout=300, json={
        "model": "toy", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices] if isinstance(prompt[0], list) else choices[0]["token_ids"]


def info(server) -> dict:
    return httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]


@pytest.mark.timeout(900)
def test_eight_concurrent_sequences_keep_their_own_state_through_preemption(toy):
    server, ckpt = toy
    first = info(server)
    assert first["state_slots"] == 4 and first["state_slots_used"] == 0
    assert first["prefix_caching"] is False
    alone = [complete(server, prompt) for prompt in PROMPTS]
    # The state carries across prompt chunks and decode steps: what a plain forward gives.
    for i in (1, 3):
        assert alone[i] == reference_tokens(ckpt, PROMPTS[i], NEW), i
    before = info(server)["preemptions"]
    start = threading.Barrier(len(PROMPTS))

    def one(prompt: list[int]) -> list[int]:
        start.wait()
        return complete(server, prompt)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(one, PROMPTS))
    batch = complete(server, PROMPTS)  # the eight as one batch, which the engine admits at once
    after = info(server)
    assert together == alone == batch
    # A preemption happens only while another sequence runs: several held state slots at once.
    assert after["preemptions"] > before, "the KV cache was meant to run out"
    assert after["state_slots_used"] == 0 and after["running"] == 0 and after["kv_usage"] == 0


def test_a_state_slot_is_cleared_for_its_next_sequence_and_copied_whole():
    from neuron.models.interface import KvState, RecurrentState
    from neuron.runner.state import StatePool

    specs = [KvState(2, 16), RecurrentState(((3,), (2, 2))), None, RecurrentState(((4,), (5,)), (torch.bfloat16,))]
    pool = StatePool(specs, 3, torch.device("cpu"))
    assert pool.slots == 3 and len(pool.tensors) == 2
    # float32: 3 + 4 + 5 (the last layer's second tensor takes the configured dtype), bf16: 4
    assert pool.nbytes == 4 * (4 * (3 + 4 + 5)) + 4 * 2 * 4 == StatePool.bytes_per_slot(specs) * 4
    assert len(pool.buffers) == 2  # one buffer per dtype, the layers' tensors views into it
    assert pool.tensors[1][0].dtype == torch.bfloat16 and pool.tensors[1][1].dtype == torch.float32
    for layer in pool.tensors:
        for t in layer:
            t.copy_(torch.randn(t.shape))
    pool.copy([1], [2])  # a snapshot of slot 1 in slot 2
    assert all(torch.equal(t[1], t[2]) for layer in pool.tensors for t in layer)
    pool.clear([1])
    assert all(not t[1].any() and t[2].any() for layer in pool.tensors for t in layer)
    assert StatePool([KvState(2, 16)], 3, torch.device("cpu")).slots == 0
    half = StatePool(specs, 3, torch.device("cpu"), torch.bfloat16)  # the configured state dtype
    assert half.tensors[0][1].dtype == torch.bfloat16 and half.nbytes == 4 * 2 * (3 + 4 + 4 + 5)


def test_the_scheduler_gives_each_running_sequence_a_state_slot_and_preemption_frees_it():
    asyncio.run(_scheduler_state_slots())


async def _scheduler_state_slots() -> None:
    from test_blocks import request

    from neuron.engine.scheduler import Scheduler

    s = Scheduler(max_slots=4, max_len=64, num_blocks=6, block_size=8, max_batch_tokens=256, prefill_chunk=64,
                  cache_key=b"k", state_slots=4)
    assert s.blocks.cache_key is None  # no prefix cache for a model with recurrent state
    reqs = [request(16, 40) for _ in range(3)]
    for r in reqs:
        s.waiting.append(r)
    admitted = s.admit()
    assert [len(r.states) for r in admitted] == [1] * len(admitted)
    assert len({r.states[0] for r in admitted}) == len(admitted) == s.states.used
    victim = admitted[-1]
    s._preempt(victim)
    assert victim.states == [] and s.states.used == len(admitted) - 1
    for r in list(s.running):
        s.release(r)
    assert s.states.used == 0


def test_a_family_module_that_cannot_be_imported_is_a_clear_refusal(monkeypatch):
    from neuron.errors import UnsupportedModel
    from neuron.loader.model_config import config_from_hf

    for name in ("no_such_family_module", "json"):  # missing, and a module without MODEL_TYPES
        monkeypatch.setenv("NEURON_FAMILIES", name)
        with pytest.raises(UnsupportedModel, match=f"NEURON_FAMILIES names '{name}'"):
            config_from_hf({"model_type": "llama"})
