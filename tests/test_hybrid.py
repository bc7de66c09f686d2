"""The hybrid family (Qwen3-Next, Qwen3.5 text, dense and MoE, and Qwen3.5 as the hub lays it
out) against HF transformers on small random checkpoints that transformers' own classes build and
save: last-position logits within 1e-4 and 32 greedy tokens equal to its ``generate``, in-process
at TP=1 and over gloo at TP=2 and 3; then (Qwen3-Next, the fused layout with sparse and shared
experts) through the real server, with prompts prefilled in chunks across steps, and 8 sequences
at once, through preemption, equal to one at a time."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import torch

from conftest import start_server
from devtools.fixture_tokenizer import BOS_TOKEN, EOS_TOKEN, build_tokenizer, write_tokenizer

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
              temporal_patch_size=2, spatial_merge_size=2)
SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=3, linear_num_value_heads=6,
             linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512)
FAMILIES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                         dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48)),
    # As the hub publishes Qwen3.5: the text config nested, a vision tower beside the text model.
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", {}),
}
PROMPTS = [[(11 * i + 7 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 23, 40))]
NEW = 32


def randomized(model, seed: int):
    """``model`` with random weights of a size that moves its outputs (decays of a usable range)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if name.endswith(("A_log", "dt_bias")) else 0.1
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return model


def write_hybrid_checkpoint(family: str, out: Path, seed: int = 0, **sizes) -> Path:
    import transformers

    config_class, model_class, extra = FAMILIES[family]
    tokenizer = build_tokenizer()
    ids = dict(bos_token_id=tokenizer.token_to_id(BOS_TOKEN), eos_token_id=tokenizer.token_to_id(EOS_TOKEN))
    if family == "qwen3_5":
        config = getattr(transformers, config_class)(text_config=SIZES | sizes | ids, vision_config=VISION)
    else:
        config = getattr(transformers, config_class)(**(SIZES | extra | sizes | ids))
    torch.manual_seed(seed)
    model = randomized(getattr(transformers, model_class)(config).to(torch.float32).eval(), seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    write_tokenizer(out, tokenizer, saved.get("text_config", saved))
    return out


def transformers_reference(ckpt: Path, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    import transformers

    architecture = json.loads((ckpt / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW, pad_token_id=0)
    return logits, out[0, len(prompt):].tolist()


def greedy_completions(server, model: str, prompt) -> list[list[int]]:
    """``NEW`` greedy tokens for ``prompt`` (one, or a batch: a list of choices each) from a
    server's /completions, in the prompts' order."""
    r = httpx.post(f"{server.base}/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


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


def job(family: str, ckpt: Path):
    from devtools.parity import ParityJob

    from neuron.loader.model_config import config_from_hf

    cfg = config_from_hf(json.loads((ckpt / "config.json").read_text()))
    assert cfg.family == family and cfg.layer_types.count("full_attention") == 1
    return ParityJob(family, "safetensors", [str(p) for p in sorted(ckpt.glob("*.safetensors"))], cfg, PROMPTS,
                     new_tokens=NEW)


def check(result, reference) -> None:
    for got, (want, _) in zip(result.logits, reference):
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert result.greedy == [tokens for _, tokens in reference]


def test_logits_and_greedy_tokens_match_transformers(hybrid):
    from devtools.parity import run_parity

    family, ckpt, reference = hybrid
    (result,) = run_parity([job(family, ckpt)])
    check(result, reference)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_cpu_ranks_give_the_same(world, tmp_path_factory):
    """At TP=3 the 3 linear-attention key heads go one to a rank, the 4 query heads 2+1+1 over
    the replicated 2 KV heads, the 4 experts 2+1+1."""
    from devtools.parity import run_parity

    families = [built(f, tmp_path_factory) for f in sorted(FAMILIES)]
    results = run_parity([job(f, ckpt) for f, ckpt, _ in families], world=world, timeout=600)
    for result, (_, _, reference) in zip(results, families):
        check(result, reference)
        assert len(result.weight_bytes) == world


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family, tp", [("qwen3_next", 1), ("qwen3_5", 2), ("qwen3_5_moe_text", 3)])
def test_the_server_serves_it_in_chunks_concurrently_and_through_preemption(tmp_path_factory, tmp_path, family, tp):
    """Each model type through the real server at one of TP=1, 2, 3: prompts shorter and longer
    than the 16-token prefill chunk, alone equal to transformers, then 8 at once (repeats among
    them, which the prefix cache serves) for four slots and a KV cache too small for all of them."""
    family, ckpt, reference = built(family, tmp_path_factory)
    # Four slots, room for about two sequences at full length, 16-token prompt chunks.
    config = (f'[[models]]\nmodel = "{ckpt}"\nid = "hybrid"\ndtype = "float32"\nmax_model_len = 80\nmax_slots = 4\n'
              f'block_size = 8\nkv_cache_tokens = 160\ntensor_parallel = {tp}\n'
              f'[engine]\nprefill_chunk = 16\nmax_queue_wait_s = 600\n')
    server = start_server(tmp_path, config=config)
    try:
        def complete(prompt):
            return greedy_completions(server, "hybrid", prompt)

        alone = [complete(p)[0] for p in PROMPTS]
        assert alone == [tokens for _, tokens in reference]
        jobs = (PROMPTS * 3)[:8]  # eight sequences for four slots, as one batch admitted at once
        assert complete(jobs) == (alone * 3)[:8]
        info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        # 4 slots for running sequences and 8 (2 each, on the CPU) for the prefix cache's snapshots
        assert info["preemptions"] > 0 and info["state_slots"] == 12 and info["state_slots_used"] == 0
        assert info["state_snapshots"] == 8 and info["prefix_caching"] and info["tensor_parallel"] == tp
        assert info["family"] == family and info["layer_types"] == {"linear_attention": 3, "full_attention": 1}
        # (12 slots + scratch) x 3 layers x fp32 x (conv state 192 channels x 3 + delta rule 6 heads x 16 x 16),
        # each rank its share of the 3 key heads (with their 2 value heads each)
        heads = [len(range(3)[r::tp]) for r in range(tp)]
        assert info["state_bytes"] == [13 * 3 * 4 * (n * 64 * 3 + 2 * n * 16 * 16) for n in heads]
    finally:
        server.stop()


def test_the_chunked_delta_rule_equals_the_recurrence_token_by_token():
    from neuron.models.recurrence import CHUNK, chunked, recurrent_step

    gen = torch.Generator().manual_seed(3)
    n, nv, hk, hv = 2 * CHUNK + 21, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(n, nv, hk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(n, nv, hv, generator=gen)
    g = -torch.rand(n, nv, generator=gen)
    beta = torch.rand(n, nv, generator=gen)
    start = torch.randn(nv, hk, hv, generator=gen)
    S, want = start, []
    for t in range(n):
        o, S = recurrent_step(q[t], k[t], v[t], g[t], beta[t], S)
        want.append(o)
    got, state = chunked(q, k, v, g, beta, start)
    assert torch.allclose(got, torch.stack(want), atol=1e-4) and torch.allclose(state, S, atol=1e-4)


@pytest.mark.parametrize("change, words", [
    ({"linear_num_key_heads": 0}, "linear_num_key_heads must be a positive integer"),
    ({"linear_conv_kernel_dim": -1}, "linear_conv_kernel_dim must be a positive integer"),
    ({"linear_num_value_heads": 7}, "multiple of linear_num_key_heads"),
    ({"head_dim": 0}, "head_dim must be a positive integer"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.3}}, "even number of dimensions"),
    ({"layer_types": ["linear_attention"] * 4}, "without a full-attention layer"),
    ({"layer_types": ["linear_attention", "sliding"]}, "layer_types must name"),
    ({"hidden_size": "wide"}, "hidden_size"),
])
def test_a_malformed_hybrid_config_is_refused_by_name_before_any_rank_starts(tmp_path_factory, tmp_path, change, words):
    """load_spec is what the leader runs on /models/load: its LoadError is the 422 the client gets."""
    import shutil

    from neuron.errors import LoadError
    from neuron.loader.spec import load_spec

    _, ckpt, _ = built("qwen3_5_text", tmp_path_factory)
    d = Path(shutil.copytree(ckpt, tmp_path / "m"))
    config = json.loads((d / "config.json").read_text()) | change
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError) as info:
        load_spec(str(d))
    assert info.value.status == 422 and words in info.value.message, info.value.message


def test_a_step_with_a_forged_state_slot_is_rejected_and_nothing_runs(tmp_path_factory):
    """The rank checks the state slot the leader sends like it checks blocks: out of range, shared by
    two sequences, a prefix-cache start on a model with state without a snapshot to start from, or
    a slot for a model without state; and the prefix cache's fields: a snapshot to start from that
    is out of range, snapshots outside the step's tokens or into a slot
    in use, a partial block to copy that is no block, or for a sequence that starts on a block
    boundary."""
    import protocol as p
    from devtools.parity import build

    from neuron.runner.runner import StepRejected

    family, ckpt, _ = built("qwen3_5_text", tmp_path_factory)
    runner, _ = build(job(family, ckpt))  # one slot per prompt: 3 state slots
    greedy = p.Sampling(temperature=0.0)

    def seq(slot: int, state: int, start: int = 0, **fields) -> p.StepSeq:
        return p.StepSeq(slot=slot, tokens=[1, 2, 3], start_pos=start, sample=True, sampling=greedy,
                         blocks=list(range(slot * 8, slot * 8 + 8)), state=state, **fields)

    for seqs, why in (([seq(0, 3)], "state slot 3 is out of range"), ([seq(0, -1)], "state slot -1"),
                      ([seq(0, 1), seq(1, 1)], "twice in the step"),
                      ([seq(0, 0, start=16)], "must start at position 0"),
                      ([seq(0, 0, start=16, state_from=7)], "state_from 7"),
                      ([seq(0, 0, state_from=1)], "state_from 1 must be a state slot (its own: restored from the host tier), for a new sequence past"),
                      ([seq(0, 0, snapshots=[(4, 1)])], "snapshot (4, 1) is outside"),
                      ([seq(0, 0, snapshots=[(2, 0)])], "snapshot (2, 0)"),
                      ([seq(0, 0), seq(1, 1, snapshots=[(3, 0)])], "snapshot (3, 0)"),
                      ([seq(0, 0, snapshots=[(3, 9)])], "snapshot (3, 9)"),
                      ([seq(0, 0, start=5, state_from=1, kv_from=10 ** 6)], "kv_from"),
                      ([seq(0, 0, start=16, state_from=1, kv_from=3)], "kv_from")):
        with pytest.raises(StepRejected, match=re.escape(why)):
            runner.step(p.Step(id=0, epoch=0, step_id=0, seqs=seqs))
    assert runner.step(p.Step(id=0, epoch=0, step_id=0, seqs=[seq(0, 2)])).wait()[0][0] >= 0

    from devtools.checkpoints import make_checkpoint
    from devtools.parity import ParityJob

    from neuron.loader.model_config import config_from_hf

    llama = make_checkpoint("llama", tmp_path_factory.mktemp("stateless"), seed=1)
    cfg = config_from_hf(json.loads((llama / "config.json").read_text()))
    stateless, _ = build(ParityJob("llama", "safetensors", [str(x) for x in llama.glob("*.safetensors")], cfg, [[1]]))
    with pytest.raises(StepRejected, match="keeps no per-sequence state"):
        stateless.step(p.Step(id=0, epoch=0, step_id=0, seqs=[seq(0, 0)]))


@pytest.mark.usefixtures("float32_activations")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2])
def test_weights_quantized_in_situ_stay_packed_and_give_their_dequantized_tokens(tmp_path_factory, world):
    """quantize = q8_0 / q4: every projection of the hybrid layers packed (the fused Qwen3-Next
    layout with its experts, and Qwen3.5's), equal to the same model with those weights
    dequantized."""
    from devtools.parity import run_parity

    jobs = []
    for family, quant in (("qwen3_next", "q4"), ("qwen3_5_text", "q8_0")):
        base = job(*built(family, tmp_path_factory)[:2])
        for dense in (True, False):
            jobs.append(msgspec_replace(base, name=f"{family}-{quant}-{dense}", quant=quant, dense=dense))
    results = run_parity(jobs, world=world, timeout=600)
    for dense, packed in zip(results[::2], results[1::2]):
        assert packed.weight_bytes[0] < 0.5 * dense.weight_bytes[0], packed.name
        assert packed.greedy == dense.greedy, packed.name
        assert all((a - b).abs().max() < 1e-3 for a, b in zip(packed.logits, dense.logits)), packed.name


def msgspec_replace(job_, **changes):
    import dataclasses

    return dataclasses.replace(job_, **changes)
