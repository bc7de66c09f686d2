"""Models that cannot be loaded are refused by the leader, before any rank exists, with an
error that names the problem: the LoadError class fixes the HTTP status (400/404/422) and code.
(The same refusals over HTTP, on a running server: test_families_server.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from neuron.errors import BadModelConfig, BadModelFile, LoadError, ModelNotFound, UnsupportedModel
from neuron.loader.spec import load_spec
from neuron.models.sharding import ShardingError, check_plan
from devtools.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("refusals") / "good", seed=3, gguf_types="Q8_0")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("refusals") / "sharded", seed=3, shards=3)


def copy(src: Path, dst: Path, *, without: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*without))
    return dst


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def refused(ref: str, kind: type[LoadError], status: int, code: str, *words: str) -> LoadError:
    with pytest.raises(LoadError) as info:
        load_spec(ref)
    err = info.value
    assert type(err) is kind, f"{type(err).__name__}: {err.message}"
    assert err.status == status and err.code == code
    for w in words:
        assert w in err.message, (w, err.message)
    return err


def test_unsupported_model_type_names_the_supported_ones(good, tmp_path):
    d = copy(good, tmp_path / "m", without=("*.gguf",))
    edit_json(d / "config.json", model_type="mistral")
    refused(str(d), UnsupportedModel, 422, "unsupported_model", "'mistral'", "llama, qwen3, qwen3_moe")
    edit_json(d / "config.json", model_type=None)
    refused(str(d), UnsupportedModel, 422, "unsupported_model", "config.json has no model_type", "qwen3_moe")


def test_unsupported_rope_scaling(good, tmp_path):
    d = copy(good, tmp_path / "m", without=("*.gguf",))
    edit_json(d / "config.json", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    refused(str(d), UnsupportedModel, 422, "unsupported_model", "rope scaling 'dynamic'", "linear, llama3, yarn")


def test_architecture_options_the_model_cannot_compute(good, tmp_path):
    d = copy(good, tmp_path / "m", without=("*.gguf",))
    edit_json(d / "config.json", hidden_act="gelu_pytorch_tanh")
    refused(str(d), UnsupportedModel, 422, "unsupported_model", "hidden_act 'gelu_pytorch_tanh'", "silu")
    edit_json(d / "config.json", hidden_act="silu", use_sliding_window=True, sliding_window=32)
    refused(str(d), UnsupportedModel, 422, "unsupported_model", "sliding-window attention")


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(path, "gemma2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    refused(str(path), UnsupportedModel, 422, "unsupported_model", "'gemma2'", "llama", "qwen3moe")


def test_config_json_that_does_not_parse(good, tmp_path):
    d = copy(good, tmp_path / "m", without=("*.gguf",))
    (d / "config.json").write_text('{"model_type": "qwen3", "hidden_size": ')
    refused(str(d), BadModelFile, 422, "invalid_model", "config.json does not parse")
    (d / "config.json").write_text("[1, 2]")
    refused(str(d), BadModelFile, 422, "invalid_model", "config.json is not a JSON object")


def test_config_json_without_a_needed_value(good, tmp_path):
    d = copy(good, tmp_path / "m", without=("*.gguf",))
    edit_json(d / "config.json", hidden_size=None)
    refused(str(d), BadModelConfig, 422, "invalid_model_config", "hidden_size")
    edit_json(d / "config.json", hidden_size="wide")
    refused(str(d), BadModelConfig, 422, "invalid_model_config", "wide")


def test_moe_config_without_experts(tmp_path):
    d = make_checkpoint("qwen3_moe", tmp_path / "moe", seed=1)
    edit_json(d / "config.json", num_experts=None, num_local_experts=None)
    refused(str(d), BadModelConfig, 422, "invalid_model_config", "num_experts")


def test_no_safetensors_weights(good, tmp_path):
    d = copy(good, tmp_path / "m", without=("*.gguf", "*.safetensors"))
    refused(str(d), ModelNotFound, 404, "model_not_found", "config.json but no .safetensors weights")


def test_a_shard_named_in_the_index_is_missing(sharded, tmp_path):
    d = copy(sharded, tmp_path / "m")
    (d / "model-00002-of-00003.safetensors").unlink()
    refused(str(d), ModelNotFound, 404, "model_not_found", "model-00002-of-00003.safetensors",
            "model.safetensors.index.json")


def test_an_index_that_does_not_parse(sharded, tmp_path):
    d = copy(sharded, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text("{not json")
    refused(str(d), BadModelFile, 422, "invalid_model", "model.safetensors.index.json does not parse")
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    refused(str(d), BadModelConfig, 422, "invalid_model_config", "weight_map")
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../../etc/passwd"}}')
    refused(str(d), BadModelConfig, 422, "invalid_model_config", "outside the model directory")


def test_truncated_or_foreign_weight_files(good, tmp_path):
    d = copy(good, tmp_path / "m", without=("*.gguf",))
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    refused(str(d), BadModelFile, 422, "invalid_model", "model.safetensors is truncated")
    weights.write_bytes(b"PK\x03\x04 this is a zip file")
    refused(str(d), BadModelFile, 422, "invalid_model", "model.safetensors is not a safetensors file")

    gguf = tmp_path / "cut.gguf"
    raw = (good / "model-Q8_0.gguf").read_bytes()
    gguf.write_bytes(raw[: len(raw) - 1000])
    refused(str(gguf), BadModelFile, 422, "invalid_model", "cut.gguf", "truncated")
    gguf.write_bytes(b"not a gguf at all")
    refused(str(gguf), BadModelFile, 422, "invalid_model", "cut.gguf is not a readable GGUF file")


def test_missing_tokenizer(good, tmp_path):
    d = copy(good, tmp_path / "m", without=("*.gguf", "tokenizer.json"))
    refused(str(d), LoadError, 400, "invalid_model", "no tokenizer.json")


def test_paths_that_hold_no_model(good, tmp_path):
    refused(str(tmp_path / "nowhere"), ModelNotFound, 404, "model_not_found", "does not exist")
    refused(str(tmp_path / "nowhere.gguf"), ModelNotFound, 404, "model_not_found", "does not exist")
    refused("not-a-repo-id", ModelNotFound, 404, "model_not_found", "neither a path nor a Hugging Face repo id")
    (tmp_path / "empty").mkdir()
    refused(str(tmp_path / "empty"), ModelNotFound, 404, "model_not_found", "holds no model")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(good / "model-Q8_0.gguf", two / name)
    refused(str(two), ModelNotFound, 404, "model_not_found", "2 .gguf files", "a.gguf", "b.gguf")


def test_tensor_parallel_sizes_the_heads_cannot_be_spread_over(good):
    cfg = load_spec(str(good)).config  # 8 query heads, 4 KV heads
    check_plan(cfg, 8)  # one query head per rank still works (KV replicated)
    with pytest.raises(ShardingError, match="tensor_parallel=9 is more ranks than the model's 8 attention heads"):
        check_plan(cfg, 9)
    import msgspec

    odd = msgspec.structs.replace(cfg, num_kv_heads=3)
    with pytest.raises(ShardingError, match="8 query heads do not form groups over 3 KV heads"):
        check_plan(odd, 1)


def test_weights_that_do_not_match_the_config(good, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy(good, tmp_path / "m", without=("*.gguf",))
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    refused(str(d), BadModelConfig, 422, "invalid_model_config", "does not match its config.json",
            "model.layers.2.mlp.up_proj.weight")
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        del tensors[name]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    err = refused(str(d), BadModelConfig, 422, "invalid_model_config", "model.layers.1.input_layernorm.weight")
    assert "more" in err.message  # a long list is cut short, with a count
    edit_json(d / "config.json", num_hidden_layers=6)  # more layers than the weights hold
    refused(str(d), BadModelConfig, 422, "invalid_model_config", "config.json gives 6 layers; the weights hold 4")
    edit_json(d / "config.json", num_hidden_layers=1_000_000)
    refused(str(d), BadModelConfig, 422, "invalid_model_config", "num_layers = 1000000 is out of range")
    edit_json(d / "config.json", num_hidden_layers=4, vocab_size=5_000_000)
    refused(str(d), BadModelConfig, 422, "invalid_model_config", "vocab_size = 5000000 is out of range")
    vocab = json.loads((good / "config.json").read_text())["vocab_size"]
    edit_json(d / "config.json", vocab_size=vocab + 64)
    refused(str(d), BadModelConfig, 422, "invalid_model_config", f"a vocabulary of {vocab + 64}", "token embedding is")


def test_gguf_tensors_that_do_not_match_its_metadata(good):
    from neuron.loader.gguf_file import GgufFile, missing_gguf_tensors
    from neuron.loader.model_config import required_tensors

    cfg = load_spec(str(good / "model-Q8_0.gguf")).config
    names = set(GgufFile(good / "model-Q8_0.gguf").tensors)
    assert missing_gguf_tensors(required_tensors(cfg), names) == []
    names.discard("blk.1.attn_k_norm.weight")
    assert missing_gguf_tensors(required_tensors(cfg), names) == ["blk.1.attn_k_norm.weight"]


def test_moe_weights_missing_an_expert(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = make_checkpoint("qwen3_moe", tmp_path / "moe", seed=1)
    load_spec(str(d))
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    refused(str(d), BadModelConfig, 422, "invalid_model_config", "model.layers.1.mlp.experts.{0..7}")


@pytest.mark.parametrize("config, words", [
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static", "weight_block_size": [128, 128]},
     ("quant_method 'fp8'", "weight_block_size [128, 128]", "activation_scheme 'static'")),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, ("'compressed-tensors'", "4-bit int")),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"},
     ("quant_method 'awq'", "bits 4", "group_size 128", "'gemv' layout")),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, ("without zero points",)),
    ({"quant_method": "gptq", "bits": 8, "group_size": 32, "checkpoint_format": "gptq_v2"},
     ("quant_method 'gptq'", "bits 8", "'gptq_v2' checkpoint format")),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, ("3-bit GPTQ",)),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, ("multiples of 32",)),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ("quant_method 'bitsandbytes'", "load_in_4bit")),
    ({"bits": 4}, ("without a quant_method",)),
])
def test_a_checkpoint_quantized_by_its_publisher_is_refused_by_its_method(good, tmp_path, config, words):
    """Not loaded as if its integers or float8 values were float weights (that answered with wrong
    tokens and no error); the message names the method (or the variant of a method neuron reads
    that it does not) and what can be loaded instead."""
    d = copy(good, tmp_path / "m", without=("*.gguf",))
    edit_json(d / "config.json", quantization_config=config)
    refused(str(d), UnsupportedModel, 422, "unsupported_model", *words, "not supported", "GGUF", "q8_0")
    nested = copy(good, tmp_path / "nested", without=("*.gguf",))
    text = json.loads((nested / "config.json").read_text()) | {"quantization_config": config}
    edit_json(nested / "config.json", text_config=text, quantization_config=None)
    refused(str(nested), UnsupportedModel, 422, "unsupported_model", "text_config", *words)


@pytest.mark.parametrize("dtype, words", [("float8_e4m3fn", ("f8_e4m3", "without a quantization_config")),
                                          ("int32", ("i32", "packed integers"))])
def test_float8_or_packed_integer_weights_without_a_config_are_refused(good, tmp_path, dtype, words):
    import torch
    from safetensors.torch import load_file, save_file

    d = copy(good, tmp_path / "m", without=("*.gguf",))
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(getattr(torch, dtype)) if dtype != "int32" else \
        torch.zeros(tensors[name].shape[0], tensors[name].shape[1] // 8, dtype=torch.int32)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    refused(str(d), UnsupportedModel, 422, "unsupported_model", *words)
