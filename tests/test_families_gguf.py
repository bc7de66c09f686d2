"""GGUF against HF transformers loading the same file: every family in every type gguf-py can
write (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1) and the K-quants (Q2_K..Q6_K, random blocks), at
TP=1 and TP=2; the default SmolLM2 GGUF; and GgufSource's partial reads against a full
dequantisation.

Both sides dequantise the same bits with gguf-py, so they agree as closely as float32 does
(measured <= 5e-6 for every type); the tolerance is the same 1e-4 as for safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from neuron.loader import gguf_source
from neuron.loader.gguf_source import GgufSource
from neuron.loader.model_config import config_from_hf
from neuron.loader.resolve import default_model_path
from neuron.loader.spec import load_spec
from neuron.models.sharding import plan_shard
from devtools.checkpoints import (
    GGUF_TYPES,
    KQUANT_TYPES,
    load_gguf_with_transformers,
    make_checkpoint,
    write_random_kquant_gguf,
)
from devtools.parity import ParityJob, run_parity

FAMILIES = ("llama", "qwen3", "qwen3_moe")
NEW_TOKENS = 32
LOGIT_TOL = 1e-4
_gen = torch.Generator().manual_seed(99)
PROMPTS = [torch.randint(0, 509, (n,), generator=_gen).tolist() for n in (9, 40)]
# K-quant blocks hold 256 values: rows of 256 and 512. 2 layers keep it small.
KQUANT_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=32, num_hidden_layers=2)
SMOL_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 2+2? Answer briefly.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a village by the sea,",
]
SMOL_TOKENS = 24


pytestmark = pytest.mark.usefixtures("one_torch_thread", "float32_activations")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(family, type) -> GGUF file."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for family in FAMILIES:
        d = make_checkpoint(family, root / family, seed=11, gguf_types=",".join(GGUF_TYPES))
        out |= {(family, t): d / f"model-{t}.gguf" for t in GGUF_TYPES}
        sizes = dict(KQUANT_SIZES, moe_intermediate_size=256) if family == "qwen3_moe" else KQUANT_SIZES
        k = make_checkpoint(family, root / f"{family}-k", seed=12, **sizes)
        out |= {(family, t): write_random_kquant_gguf(k, t, seed=13) for t in KQUANT_TYPES}
    for name, (family, gguf_type, kwargs) in BIASED.items():
        d = make_checkpoint(family, root / name, seed=14, gguf_types=gguf_type, **kwargs)
        out[name, gguf_type] = d / f"model-{gguf_type}.gguf"
    return out


TYPES = GGUF_TYPES + KQUANT_TYPES
# biases: llama.cpp permutes llama's q/k biases like the weights; mlp_bias is llama's option
BIASED = {"llama_biases": ("llama", "Q8_0", dict(attention_bias=True, mlp_bias=True)),
          "qwen3_attention_bias": ("qwen3", "Q4_1", dict(attention_bias=True))}
CASES = [(f, t) for f in FAMILIES for t in TYPES] + [(name, t) for name, (_, t, _) in BIASED.items()]


@torch.no_grad()
def hf_reference(model, prompts, new_tokens):
    model.generation_config.eos_token_id = None
    logits, greedy = [], []
    for p in prompts:
        ids = torch.tensor([p])
        logits.append(model(ids).logits[0, -1].float())
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens)
        greedy.append(out[0, len(p):].tolist())
    return logits, greedy


@pytest.fixture(scope="module")
def references(files):
    out = {}
    for (family, gguf_type), path in files.items():
        model = load_gguf_with_transformers(path.parent, gguf_type, dtype=torch.float32).eval()
        out[family, gguf_type] = hf_reference(model, PROMPTS, NEW_TOKENS)
    return out


@pytest.fixture(scope="module")
def smol():
    path = default_model_path()
    spec = load_spec(str(path))
    tk = spec.tokenizer.tokenizer
    prompts = [tk.encode(text, add_special_tokens=False).ids for text in SMOL_TEXTS]
    return path, spec, prompts


@pytest.fixture(scope="module")
def smol_reference(smol):
    from transformers import AutoModelForCausalLM

    path, _, prompts = smol
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return hf_reference(model, prompts, SMOL_TOKENS)


def jobs_for(files, smol) -> list[ParityJob]:
    jobs = []
    for (family, gguf_type), path in files.items():
        spec = load_spec(str(path))
        jobs.append(ParityJob(f"{family}-{gguf_type}", "gguf", [str(path)], spec.config, PROMPTS, NEW_TOKENS))
    path, spec, prompts = smol
    jobs.append(ParityJob("smollm2", "gguf", [str(path)], spec.config, prompts, SMOL_TOKENS))
    return jobs


@pytest.fixture(scope="module")
def runs(files, smol):
    """Every GGUF (and SmolLM2) at TP=1 in this process and at TP=2 in one gloo group."""
    jobs = jobs_for(files, smol)
    return {world: {r.name: r for r in run_parity(jobs, world)} for world in (1, 2)}


def max_diff(ours, theirs) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))


PARAMS = [pytest.param(f, t, w, id=f"{f}-{t}-tp{w}") for f, t in CASES for w in (1, 2)]


@pytest.mark.parametrize(("family", "gguf_type", "world"), PARAMS)
def test_gguf_logits_match_transformers_on_the_same_file(runs, references, family, gguf_type, world):
    result = runs[world][f"{family}-{gguf_type}"]
    ref_logits, _ = references[family, gguf_type]
    diff = max_diff(result.logits, ref_logits)
    print(f"{family} {gguf_type} TP={world}: max |logit diff| {diff:.2e}, load {result.load_seconds:.3f}s")
    assert diff <= LOGIT_TOL
    assert min(float(r.std()) for r in ref_logits) > 0.3
    assert float((ref_logits[0] - ref_logits[1]).std()) > 0.3  # the logits depend on the prompt


@pytest.mark.parametrize(("family", "gguf_type", "world"), PARAMS)
def test_gguf_greedy_tokens_match_transformers(runs, references, family, gguf_type, world):
    _, ref_tokens = references[family, gguf_type]
    assert [len(t) for t in ref_tokens] == [NEW_TOKENS] * len(PROMPTS)
    assert runs[world][f"{family}-{gguf_type}"].greedy == ref_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_quantised_files_hold_quantised_weights(files, references, family):
    """The comparisons above are not F32 against itself: each quantised type moves the logits
    away from the F32 file's by the amount its precision allows."""
    f32 = references[family, "F32"][0]
    diffs = {t: max_diff(references[family, t][0], f32) for t in GGUF_TYPES}
    print(family, {t: f"{d:.3g}" for t, d in diffs.items()})
    assert diffs["F32"] == 0.0
    assert 0 < diffs["F16"] < 0.01 and 0 < diffs["BF16"] < 0.1
    assert 0 < diffs["Q8_0"] < 0.3
    for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        assert 0.01 < diffs[t] < 3.0
    assert diffs["Q8_0"] < min(diffs[t] for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"))


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_metadata_gives_the_config_json_architecture(files, family):
    path = files[family, "Q8_0"]
    from_json = config_from_hf(json.loads((path.parent / "config.json").read_text()))
    from_gguf = load_spec(str(path)).config
    if family == "llama":
        # llama.cpp carries llama3 rope scaling as the rope_freqs tensor, not as metadata
        assert from_gguf.rope_scaling is None and from_json.rope_scaling["rope_type"] == "llama3"
        assert GgufSource(str(path), num_heads=8, num_kv_heads=2).has("rope_freqs")
        from_json = msgspec.structs.replace(from_json, rope_scaling=None)
    assert from_gguf == from_json


# ---------------------------------------------------------------------------- SmolLM2


def test_smollm2_gguf_matches_transformers_at_tp1_and_tp2(runs, smol, smol_reference):
    _, spec, prompts = smol
    ref_logits, ref_tokens = smol_reference
    assert [len(t) for t in ref_tokens] == [SMOL_TOKENS] * len(prompts)
    for world in (1, 2):
        result = runs[world]["smollm2"]
        diff = max_diff(result.logits, ref_logits)
        print(f"SmolLM2 Q4_1/Q8_0 TP={world}: max |logit diff| {diff:.2e}, load {result.load_seconds:.2f}s, "
              f"bytes {result.weight_bytes}")
        assert diff <= LOGIT_TOL
        assert result.greedy == ref_tokens


def test_smollm2_ranks_hold_their_share_at_tp2(runs, smol):
    """The weights stay packed: the Q8_0 embedding (tied LM head) in 9 bits a weight, the Q4_1
    projections in 5 (4-bit integers, a float16 scale and offset per 32), norms in float32."""
    _, spec, _ = smol
    cfg = spec.config
    whole = runs[1]["smollm2"].weight_bytes[0]
    hidden, hd, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    q8, q4 = 9 / 8, 5 / 8
    assert whole == q8 * cfg.vocab_size * hidden + 4 * hidden + layers * (
        4 * 2 * hidden + q4 * (2 * cfg.num_heads * hd * hidden + 2 * cfg.num_kv_heads * hd * hidden
                               + 3 * cfg.intermediate_size * hidden))
    for rank, actual in enumerate(runs[2]["smollm2"].weight_bytes):
        plan = plan_shard(cfg, 2, rank, 32)
        expected = q8 * cfg.vocab_size * hidden / 2 + 4 * hidden + layers * (
            4 * 2 * hidden + q4 * (2 * len(plan.q_heads) * hd * hidden + 2 * len(plan.kv_heads) * hd * hidden
                                   + 3 * len(plan.mlp) * hidden))
        print(f"SmolLM2 TP=2 rank {rank}: {actual} bytes, expected {expected:.0f} (heads {len(plan.q_heads)})")
        assert actual == expected


def test_smollm2_gguf_tokenizer_matches_transformers(smol):
    from transformers import AutoTokenizer

    path, spec, _ = smol
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = spec.tokenizer.tokenizer
    texts = SMOL_TEXTS + ["Numbers 12345 and 3.14159, émigré café, 東京, emoji 🙂!", "  spaces\n\n\ttabs  "]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------- partial reads

SLICE_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_1", "Q5_0", "BF16", "F16", "F32")


@pytest.fixture(scope="module")
def slice_file(tmp_path_factory):
    """A GGUF holding one 2-D (6 x 768) and one 3-D (4 experts x 5 x 512) tensor per type,
    quantised blocks written as raw bytes (random, with finite scales), and the full
    dequantisation of each computed from those bytes."""
    import gguf

    from devtools.checkpoints import random_quant_blocks

    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("slices") / "slices.gguf"
    writer = gguf.GGUFWriter(path, "qwen3")
    full = {}
    for layer, name in enumerate(SLICE_TYPES):
        qtype = gguf.GGMLQuantizationType[name]
        for gname, shape in ((f"blk.{layer}.ffn_gate.weight", (6, 768)), (f"blk.{layer}.ffn_down_exps.weight", (4, 5, 512))):
            if name in KQUANT_TYPES:
                raw = random_quant_blocks(name, shape, rng)
            else:
                raw = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
            writer.add_tensor(gname, raw, raw_dtype=qtype)
            full[gname] = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return path, full


@pytest.mark.parametrize("layer", range(len(SLICE_TYPES)), ids=SLICE_TYPES)
def test_partial_reads_equal_slices_of_the_full_dequantisation(slice_file, monkeypatch, layer):
    path, full = slice_file
    src = GgufSource(str(path), num_heads=1, num_kv_heads=1)
    seen: list[int] = []
    real = gguf_source.dequantize
    monkeypatch.setattr(gguf_source, "dequantize", lambda raw, q: seen.append(real(raw, q).size) or real(raw, q))

    hf, gname = f"model.layers.{layer}.mlp.gate_proj.weight", f"blk.{layer}.ffn_gate.weight"
    w = full[gname]
    assert np.isfinite(w).all() and w.std() > 0
    assert np.array_equal(src.get(hf).numpy(), w)
    cases = [(0, range(1, 4)), (1, range(256, 512)), (1, range(100, 300)), (1, range(512, 768)), (1, range(0, 768)),
             (1, range(700, 701))]
    for dim, part in cases:
        seen.clear()
        got = src.get(hf, dim=dim, part=part).numpy()
        want = w[part.start:part.stop] if dim == 0 else w[:, part.start:part.stop]
        assert got.shape == want.shape and np.array_equal(got, want), (dim, part)
        # only the rows asked for, or the blocks that hold the columns asked for, are dequantised
        if dim == 0:
            assert sum(seen) <= len(part) * w.shape[1]
        else:
            assert sum(seen) <= w.shape[0] * (len(part) + 2 * 256)

    hf3, g3 = f"model.layers.{layer}.mlp.experts.down_proj", f"blk.{layer}.ffn_down_exps.weight"
    seen.clear()
    got = src.get(hf3, dim=0, part=range(1, 3)).numpy()
    assert np.array_equal(got, full[g3][1:3])
    assert sum(seen) == (0 if SLICE_TYPES[layer] == "F32" else full[g3][1:3].size)


def test_yarn_scaling_from_gguf_metadata(tmp_path):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    d = make_checkpoint("qwen3", tmp_path / "yarn", seed=2, rope_scaling=scaling, gguf_types="F32")
    spec = load_spec(str(d / "model-F32.gguf"))
    assert spec.config == load_spec(str(d)).config and spec.config.rope_scaling == scaling
    prompt = [list(range(3, 100))]  # past the original 64 positions
    model = load_gguf_with_transformers(d, "F32", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor(prompt)).logits[0, -1]
    (result,) = run_parity([ParityJob("yarn", "gguf", [str(d / "model-F32.gguf")], spec.config, prompt, max_len=128)])
    assert float((result.logits[0] - ref).abs().max()) <= LOGIT_TOL
