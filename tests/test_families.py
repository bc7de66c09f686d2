"""Every model family against HF transformers on small random checkpoints: last-position logits
(float32, max abs diff <= 1e-4) and 32 greedy tokens, at TP=1 in this process and at TP=2/3 in
real rank processes joined by gloo, each building its own shard from the safetensors files.

Also: uneven head splits (3 KV groups over 2 ranks), more ranks than KV heads (KV replicated),
a checkpoint in three safetensors shards, both config.json styles, bfloat16/float16, and each
rank's resident weight bytes against its share computed from the checkpoint and the plan.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from neuron.loader.model_config import config_from_hf
from neuron.models.sharding import plan_shard
from devtools.checkpoints import make_checkpoint
from devtools.parity import ParityJob, ParityResult, run_parity
from protocol import ModelConfig

NEW_TOKENS = 32
LOGIT_TOL = 1e-4
# Token ids below the three specials (509-511), lengths 12, 5 and 70: the long one decodes past
# llama3's original_max_position_embeddings (64) of the tiny llama.
_gen = torch.Generator().manual_seed(1234)
PROMPTS = [torch.randint(0, 509, (n,), generator=_gen).tolist() for n in (12, 5, 70)]

# name: (family, make_checkpoint kwargs, TP sizes besides 1)
CASES: dict[str, tuple[str, dict, tuple[int, ...]]] = {
    # llama3 rope scaling, tied embeddings; 8 query / 2 KV heads (TP=3: KV replicated, queries 3+3+2)
    "llama": ("llama", {}, (2, 3)),
    # q/k norm, untied LM head; 8 query / 4 KV heads
    "qwen3": ("qwen3", {}, (2,)),
    # 8 experts, top-2, one all-reduce per MoE block
    "qwen3_moe": ("qwen3_moe", {}, (2,)),
    # 3 KV groups of 3 heads over 2 ranks: 2+1; MLP 100 = 50+50 (TP=3: 34+33+33, vocab padded)
    "llama_9q_3kv": ("llama", dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72,
                                   intermediate_size=100), (2, 3)),
    # one KV head: every rank replicates it and takes a share of the queries
    "qwen3_1kv": ("qwen3", dict(num_key_value_heads=1), (2, 3)),
    # 6 query / 2 KV heads at TP=3: the middle rank reads both KV groups; experts 2+2+1
    "qwen3_moe_6q_2kv_5e": ("qwen3_moe", dict(num_attention_heads=6, num_key_value_heads=2, num_experts=5), (2, 3)),
    # the same architecture as "qwen3", saved in three safetensors files with an index
    "qwen3_3_shards": ("qwen3", dict(shards=3, seed=7), (2,)),
    # the other RoPE scalings; prompts + 32 tokens run past original_max_position_embeddings
    "qwen3_yarn": ("qwen3", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                                               "original_max_position_embeddings": 64}), ()),
    "llama_linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), ()),
    # biases: q/k/v/o (attention_bias) and llama's mlp_bias; row-parallel biases added once
    "llama_biases": ("llama", dict(attention_bias=True, mlp_bias=True), (2,)),
    "qwen3_attention_bias": ("qwen3", dict(attention_bias=True), (2,)),
}
WORLDS = {w: [n for n, (_, _, ws) in CASES.items() if w == 1 or w in ws] for w in (1, 2, 3)}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, (family, kwargs, _) in CASES.items():
        kwargs = {"seed": 3, **kwargs}
        out[name] = make_checkpoint(family, root / name, **kwargs)
    return out


def read_config(directory: Path) -> ModelConfig:
    return config_from_hf(json.loads((directory / "config.json").read_text()))


def safetensors_paths(directory: Path) -> list[str]:
    return [str(p) for p in sorted(directory.glob("*.safetensors"))]


def hf_model(directory: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
    model.generation_config.eos_token_id = None  # 32 tokens always, as the server's ignore_eos
    return model


@torch.no_grad()
def hf_reference(model, prompts=PROMPTS, new_tokens=NEW_TOKENS) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per prompt: transformers' last-position logits and ``generate(do_sample=False)`` tokens.
    The attention mask is explicit: without it, transformers masks out every prompt token equal
    to the pad id."""
    logits, greedy = [], []
    for p in prompts:
        ids = torch.tensor([p])
        logits.append(model(ids).logits[0, -1].float())
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens)
        greedy.append(out[0, len(p):].tolist())
    return logits, greedy


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, tuple[list[torch.Tensor], list[list[int]]]]:
    return {name: hf_reference(hf_model(d)) for name, d in checkpoints.items()}


def job(name: str, directory: Path, dtype: str = "float32") -> ParityJob:
    return ParityJob(name, "safetensors", safetensors_paths(directory), read_config(directory), PROMPTS,
                     NEW_TOKENS, dtype=dtype)


@pytest.fixture(scope="module")
def runs(checkpoints) -> dict[int, dict[str, ParityResult]]:
    """Every case at every TP size it lists: one process group per TP size for all of them."""
    out = {}
    for world, names in WORLDS.items():
        results = run_parity([job(n, checkpoints[n]) for n in names], world)
        out[world] = {r.name: r for r in results}
    return out


def max_diff(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))


PARAMS = [pytest.param(n, w, id=f"{n}-tp{w}") for w, names in WORLDS.items() for n in names]


@pytest.mark.parametrize(("name", "world"), PARAMS)
def test_logits_match_transformers(runs, references, name, world):
    result = runs[world][name]
    ref_logits, _ = references[name]
    assert len(result.logits) == len(PROMPTS)
    diff = max_diff(result.logits, ref_logits)
    print(f"{name} TP={world}: max |logit diff| {diff:.2e}, load {result.load_seconds:.3f}s")
    assert diff <= LOGIT_TOL
    # the logits are not flat: a diff bound on near-constant logits would prove nothing
    assert min(float(r.std()) for r in ref_logits) > 0.3


@pytest.mark.parametrize(("name", "world"), PARAMS)
def test_greedy_tokens_match_transformers_generate(runs, references, name, world):
    _, ref_tokens = references[name]
    assert [len(t) for t in ref_tokens] == [NEW_TOKENS] * len(PROMPTS)
    assert runs[world][name].greedy == ref_tokens


def test_plans_used_here_split_as_described(checkpoints):
    def heads(name, world):
        cfg = read_config(checkpoints[name])
        return [(len(p.q_heads), len(p.kv_heads)) for p in (plan_shard(cfg, world, r) for r in range(world))]

    assert heads("llama_9q_3kv", 2) == [(6, 2), (3, 1)]
    assert heads("qwen3_1kv", 2) == [(4, 1), (4, 1)]
    assert heads("llama", 3) == [(3, 1), (3, 2), (2, 1)]
    assert heads("qwen3_moe_6q_2kv_5e", 3) == [(2, 1), (2, 2), (2, 1)]
    cfg = read_config(checkpoints["qwen3_moe_6q_2kv_5e"])
    assert [len(plan_shard(cfg, 3, r).experts) for r in range(3)] == [2, 2, 1]


# ---------------------------------------------------------------------------- sharded files


def test_three_safetensors_shards_load_as_one_checkpoint(checkpoints, runs, references):
    d = checkpoints["qwen3_3_shards"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (d / "model.safetensors").exists()
    from neuron.loader.spec import load_spec

    spec = load_spec(str(d))
    assert [p.name for p in spec.files.paths] == files
    # same architecture as "qwen3", different seed: the weights really come from the shards
    assert read_config(d) == read_config(checkpoints["qwen3"])
    assert max_diff(runs[1]["qwen3_3_shards"].logits, references["qwen3"][0]) > 0.1


# ---------------------------------------------------------------------------- resident bytes


def checkpoint_tensors(directory: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (shape, bytes) of every tensor in the checkpoint's files."""
    out = {}
    for path in safetensors_paths(directory):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                shape = tuple(t.get_shape())
                size = {"F32": 4, "BF16": 2, "F16": 2}[t.get_dtype()]
                n = 1
                for s in shape:
                    n *= s
                out[name] = (shape, n * size)
    return out


def expected_share(tensors: dict[str, tuple[tuple[int, ...], int]], cfg: ModelConfig, world: int,
                   rank: int) -> tuple[float, float]:
    """(this rank's share of the sharded tensors, the replicated tensors' bytes), from the
    checkpoint's own tensor sizes and the rank's plan. The vocabulary share is the ideal
    1/world, so padding counts against the bound; KV heads a rank must replicate count as
    replicated."""
    plan = plan_shard(cfg, world, rank)
    sharded = replicated = 0.0
    for name, (_, nbytes) in tensors.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            sharded += nbytes / world
        elif re.search(r"self_attn\.(q|o)_proj\.weight$", name):
            sharded += nbytes * len(plan.q_heads) / cfg.num_heads
        elif re.search(r"self_attn\.(k|v)_proj\.weight$", name):
            share = len(plan.kv_heads) / cfg.num_kv_heads
            sharded += nbytes * min(share, 1 / world)
            replicated += nbytes * max(0.0, share - 1 / world)
        elif m := re.search(r"mlp\.experts\.(\d+)\.", name):
            sharded += nbytes if int(m[1]) in plan.experts else 0
        elif re.search(r"mlp\.(gate|up|down)_proj\.weight$", name) or re.search(r"mlp\.(gate|up)_proj\.bias$", name):
            sharded += nbytes * len(plan.mlp) / cfg.intermediate_size
        elif re.search(r"self_attn\.q_proj\.bias$", name):
            sharded += nbytes * len(plan.q_heads) / cfg.num_heads
        elif re.search(r"self_attn\.(k|v)_proj\.bias$", name):
            sharded += nbytes * len(plan.kv_heads) / cfg.num_kv_heads
        elif re.search(r"(o_proj|down_proj)\.bias$", name):  # row-parallel: rank 0 adds it
            sharded += nbytes if rank == 0 else 0
        elif name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
            replicated += nbytes
        else:
            raise AssertionError(f"unclassified tensor {name}")
    return sharded, replicated


@pytest.mark.parametrize(("name", "world"), [p for p in PARAMS if p.values[1] > 1])
def test_each_rank_holds_its_share_of_the_weights(checkpoints, runs, name, world):
    d = checkpoints[name]
    tensors = checkpoint_tensors(d)
    cfg = read_config(d)
    got = runs[world][name].weight_bytes
    whole = runs[1][name].weight_bytes[0]
    assert whole == sum(n for _, n in tensors.values())  # TP=1 holds exactly the checkpoint
    assert len(got) == world
    for rank, actual in enumerate(got):
        sharded, replicated = expected_share(tensors, cfg, world, rank)
        expected = sharded + replicated
        print(f"{name} TP={world} rank {rank}: {actual} bytes, expected {expected:.0f} "
              f"({sharded:.0f} sharded + {replicated:.0f} replicated)")
        assert abs(actual - expected) <= 0.10 * expected
    # nothing but the replicated part is held twice
    total_replicated = sum(expected_share(tensors, cfg, world, r)[1] for r in range(world))
    assert sum(got) <= whole + total_replicated + 0.01 * whole


# ---------------------------------------------------------------------------- config styles


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_both_config_styles_give_the_same_model(tmp_path, family):
    hub = make_checkpoint(family, tmp_path / "hub", seed=5, config_style="hub")
    modern = make_checkpoint(family, tmp_path / "modern", seed=5, config_style="rope_parameters")
    raw = json.loads((modern / "config.json").read_text())
    assert "rope_parameters" in raw and "rope_scaling" not in raw and "rope_theta" not in raw
    cfg_hub, cfg_modern = read_config(hub), read_config(modern)
    assert cfg_hub == cfg_modern
    if family == "llama":
        assert cfg_hub.rope_scaling["rope_type"] == "llama3" and cfg_hub.rope_scaling["factor"] == 8.0
    if family == "qwen3_moe":
        assert "num_local_experts" in raw and cfg_modern.num_experts == 8
    a, b = run_parity([job("hub", hub), job("modern", modern)])
    assert max_diff(a.logits, b.logits) == 0.0 and a.greedy == b.greedy
    assert max_diff(a.logits, hf_reference(hf_model(modern), new_tokens=1)[0]) <= LOGIT_TOL


# ---------------------------------------------------------------------------- dtypes

# Measured max |diff| against transformers in float32 (logits std ~1): bfloat16 ~0.05-0.1,
# float16 ~0.005. The bounds leave about 2x room.
DTYPE_TOL = {"bfloat16": 0.25, "float16": 0.02}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe"])
def test_half_precision_runs_on_cpu_and_stays_close(checkpoints, references, runs, name, dtype):
    (result,) = run_parity([job(name, checkpoints[name], dtype)])
    diff = max_diff(result.logits, references[name][0])
    print(f"{name} {dtype}: max |logit diff| vs float32 transformers {diff:.3e}")
    assert all(torch.isfinite(x).all() for x in result.logits)
    assert 0 < diff <= DTYPE_TOL[dtype]
    assert result.weight_bytes[0] * 2 == runs[1][name].weight_bytes[0]
    # the greedy continuation starts the same way (the first tokens come from well-separated logits)
    assert [g[:1] for g in result.greedy] == [g[:1] for g in references[name][1]]
