"""The hybrid family (Qwen3-Next, Qwen3.5 text, dense and MoE) against HF transformers on small random
checkpoints that transformers' own classes build and save: last-position logits within 1e-4 and
32 greedy tokens equal to its ``generate``, in-process at TP=1; then (Qwen3-Next, the fused layout
with sparse and shared experts) through the real server, with prompts prefilled in chunks across
steps, and 8 sequences at once, through preemption, equal to one at a time."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from conftest import start_server
from devtools.fixture_tokenizer import BOS_TOKEN, EOS_TOKEN, build_tokenizer, write_tokenizer

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512)
FAMILIES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                         dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48)),
}
PROMPTS = [[(11 * i + 7 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 23, 40))]
NEW = 32


def write_hybrid_checkpoint(family: str, out: Path, seed: int = 0) -> Path:
    import transformers

    config_class, model_class, extra = FAMILIES[family]
    tokenizer = build_tokenizer()
    config = getattr(transformers, config_class)(
        **SIZES, **extra, bos_token_id=tokenizer.token_to_id(BOS_TOKEN), eos_token_id=tokenizer.token_to_id(EOS_TOKEN))
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if name.endswith(("A_log", "dt_bias")) else 0.1
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_tokenizer(out, tokenizer, json.loads((out / "config.json").read_text()))
    return out


def transformers_reference(ckpt: Path, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW, pad_token_id=0)
    return logits, out[0, len(prompt):].tolist()


_BUILT: dict[str, tuple[Path, list]] = {}


def built(family: str, tmp_path_factory) -> tuple[str, Path, list]:
    """The family's checkpoint and transformers' answers to PROMPTS, made once per session."""
    if family not in _BUILT:
        ckpt = write_hybrid_checkpoint(family, tmp_path_factory.mktemp(family))
        _BUILT[family] = ckpt, [transformers_reference(ckpt, p) for p in PROMPTS]
    return family, *_BUILT[family]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hybrid(request, tmp_path_factory):
    return built(request.param, tmp_path_factory)


def test_logits_and_greedy_tokens_match_transformers(hybrid):
    from devtools.parity import ParityJob, run_parity

    from neuron.loader.model_config import config_from_hf

    family, ckpt, reference = hybrid
    cfg = config_from_hf(json.loads((ckpt / "config.json").read_text()))
    assert cfg.family == family and cfg.layer_types.count("full_attention") == 1
    job = ParityJob(family, "safetensors", [str(p) for p in sorted(ckpt.glob("*.safetensors"))], cfg, PROMPTS,
                    new_tokens=NEW)
    (result,) = run_parity([job])
    for got, (want, _) in zip(result.logits, reference):
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert result.greedy == [tokens for _, tokens in reference]


@pytest.mark.timeout(600)
def test_the_server_serves_it_in_chunks_concurrently_and_through_preemption(tmp_path_factory, tmp_path):
    family, ckpt, reference = built("qwen3_next", tmp_path_factory)
    # Four slots, room for about two sequences at full length, 16-token prompt chunks.
    config = (f'[[models]]\nmodel = "{ckpt}"\nid = "hybrid"\ndtype = "float32"\nmax_model_len = 80\nmax_slots = 4\n'
              f'block_size = 8\nkv_cache_tokens = 160\n[engine]\nprefill_chunk = 16\nmax_queue_wait_s = 600\n')
    server = start_server(tmp_path, config=config)
    try:
        def complete(prompt):
            r = httpx.post(f"{server.base}/completions", timeout=300, json={
                "model": "hybrid", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

        alone = [complete(p)[0] for p in PROMPTS]
        assert alone == [tokens for _, tokens in reference]
        jobs = (PROMPTS * 3)[:8]  # eight sequences for four slots, as one batch admitted at once
        assert complete(jobs) == (alone * 3)[:8]
        info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        assert info["preemptions"] > 0 and info["state_slots"] == 4 and info["state_slots_used"] == 0
        assert info["family"] == family and info["layer_types"] == {"linear_attention": 3, "full_attention": 1}
        # (4 slots + scratch) x 3 layers x fp32 x (conv state 128 channels x 3 + delta rule 4 heads x 16 x 16)
        assert info["state_bytes"][0] == 5 * 3 * 4 * (128 * 3 + 4 * 16 * 16)
    finally:
        server.stop()
