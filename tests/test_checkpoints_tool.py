"""The checkpoint tool's outputs load in transformers and are reproducible."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from devtools.checkpoints import FAMILIES, make_checkpoint, read_safetensors
from devtools.fixture_tokenizer import CHAT_TEMPLATE, IM_END
from devtools.gguf_writer import GGUF_TYPES, parse_gguf_types, permute_qk

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = torch.tensor([[3, 17, 300, 42, 509, 510, 100, 7, 250, 400, 33, 12]])
needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="transformers needs accelerate to load GGUF files"
)


def _logits(model_dir: Path, **kwargs: Any) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(PROMPT).logits


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        (family, style): make_checkpoint(family, root / f"{family}-{style}", seed=1, config_style=style)
        for family in FAMILIES
        for style in ("hub", "rope_parameters")
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_both_config_styles_load_as_the_same_model(checkpoints: dict[tuple[str, str], Path], family: str) -> None:
    from transformers import AutoConfig

    hub, modern = checkpoints[family, "hub"], checkpoints[family, "rope_parameters"]
    hub_json, modern_json = _read_json(hub / "config.json"), _read_json(modern / "config.json")
    assert "rope_parameters" not in hub_json and "rope_theta" in hub_json and "rope_scaling" in hub_json
    assert "rope_theta" not in modern_json and "rope_scaling" not in modern_json
    assert modern_json["rope_parameters"]["rope_theta"] == hub_json["rope_theta"]

    hub_config, modern_config = AutoConfig.from_pretrained(hub), AutoConfig.from_pretrained(modern)
    assert hub_config.rope_parameters == modern_config.rope_parameters
    if family == "llama":
        assert hub_json["rope_scaling"]["rope_type"] == "llama3"
        assert hub_config.rope_parameters["rope_type"] == "llama3"
        assert hub_config.tie_word_embeddings is True
    else:
        assert hub_config.head_dim == 16
        assert hub_config.tie_word_embeddings is False
    if family == "qwen3_moe":
        assert hub_json["num_experts"] == modern_json["num_local_experts"] == 8
        assert hub_config.num_local_experts == modern_config.num_local_experts == 8

    hub_logits = _logits(hub)
    assert torch.isfinite(hub_logits).all()
    assert hub_logits.std() > 0.3, "logits should not be flat"
    torch.testing.assert_close(_logits(modern), hub_logits, rtol=0, atol=0)


def test_tokenizer_and_generation_config(checkpoints: dict[tuple[str, str], Path]) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    model_dir = checkpoints["qwen3", "hub"]
    config = _read_json(model_dir / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) == config["vocab_size"] == 512
    assert tokenizer.eos_token == IM_END
    assert tokenizer.convert_tokens_to_ids(IM_END) == config["eos_token_id"]
    assert _read_json(model_dir / "tokenizer_config.json")["chat_template"] == CHAT_TEMPLATE

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text)["input_ids"]
    assert ids.count(config["eos_token_id"]) == 2
    assert tokenizer.decode(ids) == text

    generation = GenerationConfig.from_pretrained(model_dir)
    assert (generation.temperature, generation.top_p) == (0.7, 0.9)
    assert generation.eos_token_id == config["eos_token_id"]


@pytest.mark.parametrize("family", FAMILIES)
def test_three_shards(checkpoints: dict[tuple[str, str], Path], tmp_path: Path, family: str) -> None:
    sharded = make_checkpoint(family, tmp_path / "sharded", seed=1, shards=3)
    files = sorted(path.name for path in sharded.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = _read_json(sharded / "model.safetensors.index.json")
    assert set(index["weight_map"].values()) == set(files)

    single = read_safetensors(checkpoints[family, "hub"])
    assert set(index["weight_map"]) == set(single)
    assert index["metadata"]["total_size"] == sum(array.nbytes for array in single.values())
    torch.testing.assert_close(_logits(sharded), _logits(checkpoints[family, "hub"]), rtol=0, atol=0)


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    first = make_checkpoint("qwen3_moe", tmp_path / "a", seed=7, gguf_types="Q4_0")
    second = make_checkpoint("qwen3_moe", tmp_path / "b", seed=7, gguf_types="Q4_0")
    other = make_checkpoint("qwen3_moe", tmp_path / "c", seed=8)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "model-Q4_0.gguf"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_overrides_and_bad_arguments(tmp_path: Path) -> None:
    model_dir = make_checkpoint("qwen3", tmp_path / "gqa", num_attention_heads=9, num_key_value_heads=3)
    config = _read_json(model_dir / "config.json")
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert _logits(model_dir).shape == (1, PROMPT.shape[1], 512)
    with pytest.raises(ValueError, match="cannot write"):
        parse_gguf_types("F32,Q4_K")
    with pytest.raises(ValueError, match="family"):
        make_checkpoint("mistral", tmp_path / "x")


def _gguf_reader(path: Path) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents()


@pytest.mark.parametrize(("family", "arch"), [("llama", "llama"), ("qwen3", "qwen3"), ("qwen3_moe", "qwen3moe")])
def test_gguf_layout(tmp_path: Path, family: str, arch: str) -> None:
    model_dir = make_checkpoint(family, tmp_path / family, gguf_types="F32,Q8_0")
    config = _read_json(model_dir / "config.json")
    reader = _gguf_reader(model_dir / "model-Q8_0.gguf")
    tensors = {tensor.name: tensor for tensor in reader.tensors}

    assert _field(reader, "general.architecture") == arch
    assert _field(reader, f"{arch}.block_count") == config["num_hidden_layers"]
    assert _field(reader, f"{arch}.attention.head_count_kv") == config["num_key_value_heads"]
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.eos_token_id") == config["eos_token_id"]
    assert _field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == config["vocab_size"]
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    assert ("output.weight" in tensors) == (family != "llama")

    if family == "llama":
        assert "rope_freqs.weight" in tensors
        assert _field(reader, "llama.rope.dimension_count") == config["head_dim"]
        f32 = {tensor.name: tensor for tensor in _gguf_reader(model_dir / "model-F32.gguf").tensors}
        hf_q = read_safetensors(model_dir)["model.layers.0.self_attn.q_proj.weight"]
        np.testing.assert_array_equal(np.asarray(f32["blk.0.attn_q.weight"].data), permute_qk(hf_q, 8))
    else:
        assert _field(reader, f"{arch}.attention.key_length") == 16
        assert "blk.0.attn_q_norm.weight" in tensors
    if family == "qwen3_moe":
        assert _field(reader, "qwen3moe.expert_count") == 8
        assert _field(reader, "qwen3moe.expert_used_count") == 2
        assert _field(reader, "qwen3moe.expert_feed_forward_length") == 32
        assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
        assert list(tensors["blk.0.ffn_down_exps.weight"].shape) == [32, 64, 8]


def test_gguf_falls_back_to_f16_for_unaligned_rows(tmp_path: Path) -> None:
    # 9 heads x head_dim 16 = 144 columns in attn_output, not a multiple of Q4_0's 32-wide blocks.
    model_dir = make_checkpoint(
        "qwen3", tmp_path / "odd", gguf_types="Q4_0", num_attention_heads=9, num_key_value_heads=3
    )
    tensors = {tensor.name: tensor for tensor in _gguf_reader(model_dir / "model-Q4_0.gguf").tensors}
    assert tensors["blk.0.attn_output.weight"].tensor_type.name == "F16"
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q4_0"


@needs_accelerate
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_matches_safetensors_in_transformers(tmp_path: Path, family: str) -> None:
    from devtools.checkpoints import load_gguf_with_transformers

    model_dir = make_checkpoint(family, tmp_path / family, shards=2, gguf_types="F32,Q8_0")
    reference = _logits(model_dir)

    def gguf_error(gguf_type: str) -> torch.Tensor:
        model = load_gguf_with_transformers(model_dir, gguf_type, dtype=torch.float32).eval()
        with torch.no_grad():
            return (model(PROMPT).logits - reference).abs()

    assert gguf_error("F32").max() < 1e-4
    # Mean, not max: quantisation can flip a token's top-k experts, which moves a few logits a lot.
    assert gguf_error("Q8_0").mean() < 0.05


# Mean |logit error| against the float32 safetensors model; logits have std ~0.8.
_QUANT_TOLERANCE = {"F16": 0.005, "BF16": 0.02, "Q8_0": 0.05, "Q5_0": 0.2, "Q5_1": 0.2, "Q4_0": 0.3, "Q4_1": 0.3}


@needs_accelerate
def test_every_gguf_type_loads_in_transformers(tmp_path: Path) -> None:
    from devtools.checkpoints import load_gguf_with_transformers

    model_dir = make_checkpoint("qwen3", tmp_path / "qwen3", gguf_types=",".join(GGUF_TYPES))
    reference = _logits(model_dir)
    for gguf_type in GGUF_TYPES:
        model = load_gguf_with_transformers(model_dir, gguf_type, dtype=torch.float32).eval()
        with torch.no_grad():
            error = (model(PROMPT).logits - reference).abs().mean()
        assert error < _QUANT_TOLERANCE.get(gguf_type, 1e-6), (gguf_type, float(error))


def test_cli(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "make-checkpoint"), "--family", "llama", "--out", str(out),
         "--seed", "2", "--shards", "2", "--config-style", "rope_parameters", "--gguf", "q8_0",
         "--set", "num_hidden_layers=2", "--set", "rope_theta=500000.0"],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    config = _read_json(out / "config.json")
    assert config["num_hidden_layers"] == 2
    assert config["rope_parameters"]["rope_theta"] == 500000.0
    assert (out / "model-Q8_0.gguf").exists()
    assert len(list(out.glob("model-*-of-00002.safetensors"))) == 2



def test_cli_rejects_types_gguf_py_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loader = importlib.machinery.SourceFileLoader("make_checkpoint_cli", str(REPO_ROOT / "scripts" / "make-checkpoint"))
    cli = types.ModuleType(loader.name)
    cli.__file__ = loader.path
    loader.exec_module(cli)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--family", "llama", "--out", str(tmp_path / "bad"), "--gguf", "Q6_K"])
    assert exit_info.value.code == 2
    assert "Q6_K" in capsys.readouterr().err
    assert cli.parse_override("rope_scaling=null") == ("rope_scaling", None)
    assert cli.parse_override("name=tiny") == ("name", "tiny")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_shaped_checkpoint_loads_strictly_in_transformers_and_in_neuron(tmp_path: Path, family: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The perf tool's writer (real shapes, written tensor by tensor), at a tiny shape: every
    tensor name and shape is what transformers expects, and neuron's model gives its logits."""
    from transformers import AutoModelForCausalLM

    from neuron.loader.model_config import config_from_hf
    from devtools import shapes
    from devtools.parity import ParityJob, run_parity

    monkeypatch.setitem(shapes.SHAPES, "tiny", {
        "model_type": family, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 600, "tie_word_embeddings": family == "llama"})
    out = shapes.make_shaped_checkpoint("tiny", tmp_path / "m", dtype="float32", seed=5)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["eos_token_id"] < 600
    with torch.no_grad():
        want = model.eval()(PROMPT).logits[0, -1]
    paths = [str(p) for p in sorted(out.glob("*.safetensors"))]
    job = ParityJob("tiny", "safetensors", paths, config_from_hf(config), [PROMPT[0].tolist()])
    got = run_parity([job])[0].logits[0]
    assert float((got - want).abs().max()) < 1e-4
