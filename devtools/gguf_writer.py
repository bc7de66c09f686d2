"""GGUF files of a test checkpoint, laid out the way llama.cpp's convert_hf_to_gguf.py lays
them out (and random valid K-quant blocks, to compare two readers' dequantisation)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from neuron.loader.gguf_file import GLOBAL_TENSORS, LAYER_TENSORS

from .families import (FamilySpec, family_of, family_spec, head_dim, hub_names, natural_key, read_json, read_safetensors,
                       to_hub_rope)
from .fixture_tokenizer import GGUF_TOKENIZER_PRE

# What gguf-py 0.19 can quantise itself; the K-quants (Q4_K, Q5_K, Q6_K, ...) only dequantise.
GGUF_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# K-quants that `write_random_kquant_gguf` fills with random, valid blocks (not the checkpoint's
# weights): enough to check that two readers dequantise the same bits the same way.
KQUANT_TYPES: tuple[str, ...] = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def parse_gguf_types(gguf_types: str | None) -> list[str]:
    if not gguf_types:
        return []
    names = [name.strip().upper() for name in gguf_types.split(",") if name.strip()]
    unsupported = [name for name in names if name not in GGUF_TYPES]
    if unsupported:
        raise ValueError(f"gguf-py cannot write {unsupported}; supported: {list(GGUF_TYPES)}")
    return list(dict.fromkeys(names))


_GLOBAL_TENSORS = {k: v for k, v in GLOBAL_TENSORS.items() if k != "rope_freqs"}
_LAYER_TENSORS = {k: v for k, v in LAYER_TENSORS.items() if not k.startswith("mlp.experts.")}
_EXPERT_TENSORS = {
    "gate_proj": "ffn_gate_exps.weight",
    "up_proj": "ffn_up_exps.weight",
    "down_proj": "ffn_down_exps.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def write_gguf(out_dir: str | Path, gguf_type: str) -> Path:
    """Convert the checkpoint in `out_dir` to `out_dir/model-<TYPE>.gguf` and return its path."""
    (type_name,) = parse_gguf_types(gguf_type)
    return _write_gguf(Path(out_dir), type_name, None)


def write_random_kquant_gguf(out_dir: str | Path, gguf_type: str, *, seed: int = 0) -> Path:
    """`out_dir/model-<TYPE>.gguf` for a K-quant TYPE (Q2_K ... Q6_K), laid out like `write_gguf`'s
    files, but every tensor that would be quantised holds random valid blocks (scales drawn so the
    weights stay around +-0.1) instead of the checkpoint's weights; norms and the router keep the
    checkpoint's values. Rows must be multiples of 256 to be quantised (else they stay F16), so
    use a config with hidden_size and intermediate sizes in multiples of 256."""
    type_name = gguf_type.strip().upper()
    if type_name not in KQUANT_TYPES:
        raise ValueError(f"{gguf_type!r} is not one of {list(KQUANT_TYPES)}")
    return _write_gguf(Path(out_dir), type_name, np.random.default_rng(seed))


# Byte offsets of the float16 scale fields in one block of each K-quant (ggml-common.h).
# Typical magnitudes: w = d*scale*q (- dmin*min), with dmin about mean(q)*d so the weights have
# mean ~0 (otherwise the logits hardly depend on the prompt).
_KQUANT_F16_FIELDS: dict[str, tuple[tuple[int, float], ...]] = {
    "Q2_K": ((80, 4e-3), (82, 6e-3)),  # scales[16] qs[64] d dmin; q in 0..3
    "Q3_K": ((108, 8e-4),),  # hmask[32] qs[64] scales[12] d; signed
    "Q4_K": ((0, 2e-4), (2, 1.5e-3)),  # d dmin scales[12] qs[128]; q in 0..15
    "Q5_K": ((0, 1e-4), (2, 1.55e-3)),  # d dmin scales[12] qh[32] qs[128]; q in 0..31
    "Q6_K": ((208, 2.5e-5),),  # ql[128] qh[64] scales[16] d; signed
    "Q4_0": ((0, 4e-3),),  # d qs[16]; w = d * (q - 8), q in 0..15
    "Q8_0": ((0, 3e-4),),  # d qs[32]; signed
}


def random_quant_blocks(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bytes for a tensor of logical `shape` (last dim a multiple of the block size) in the
    K-quant (or Q4_0, Q8_0) `type_name`, as GGUFWriter.add_tensor(..., raw_dtype=...) takes them: uint8, the last
    dim in bytes. The float16 scales are set to small positive values so nothing is inf/nan."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if shape[-1] % block:
        raise ValueError(f"row length {shape[-1]} is not a multiple of {type_name}'s block of {block}")
    n_blocks = int(np.prod(shape[:-1])) * (shape[-1] // block)
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for offset, scale in _KQUANT_F16_FIELDS[type_name]:
        values = (scale * rng.uniform(0.5, 1.5, size=n_blocks)).astype(np.float16)
        raw[:, offset:offset + 2] = values.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def _write_gguf(out: Path, type_name: str, rng: np.random.Generator | None) -> Path:
    import gguf

    config = to_hub_rope(hub_names(read_json(out / "config.json")))
    spec = family_spec(family_of(config["model_type"]))
    qtype = gguf.GGMLQuantizationType[type_name]
    path = out / f"model-{type_name}.gguf"

    writer = open_writer(path, spec.gguf_arch, f"neuron-tiny-{config['model_type']}", type_name, out,
                         config["vocab_size"], lambda w: add_hparams(w, spec, config))
    for name, array in _gguf_tensors(spec, config, read_safetensors(out)):
        kind = tensor_type(name, array, qtype)
        if rng is not None and kind == qtype:
            data = random_quant_blocks(type_name, array.shape, rng)
        else:
            data = gguf.quants.quantize(array, kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    return finish(writer, path)


def open_writer(path: Path, arch: str, name: str, type_name: str, out: Path, vocab_size: int,
                hparams: Any, pads_are_text: bool = False) -> Any:
    """A GGUFWriter with a model file's metadata: its name, ``hparams(writer)``'s keys, the file
    type, the vocabulary of ``out``'s tokenizer padded to ``vocab_size``."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    hparams(writer)
    writer.add_file_type(file_type(type_name))
    add_vocab(writer, out, vocab_size, pads_are_text)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return writer


def finish(writer: Any, path: Path) -> Path:
    """Write the GGUF file out: header, metadata, tensors."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return path


def add_hparams(writer: Any, spec: FamilySpec, config: dict[str, Any]) -> None:
    """The keys convert_hf_to_gguf.py writes (TextModel, LlamaModel, Qwen2MoeModel)."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    _add_rope_scaling(writer, config.get("rope_scaling"))
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if "num_experts" in config:
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if spec.gguf_arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim(config))


def _rope_type(rope_scaling: dict[str, Any] | None) -> str:
    scaling = rope_scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _add_rope_scaling(writer: Any, rope_scaling: dict[str, Any] | None) -> None:
    import gguf

    rope_type, scaling = _rope_type(rope_scaling), rope_scaling or {}
    if rope_type in ("default", "llama3"):
        return  # llama3 is carried by the rope_freqs tensor instead
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    else:
        raise ValueError(f"no GGUF encoding for rope_type {rope_type!r}")


def file_type(type_name: str) -> int:
    import gguf

    if type_name == "F32":
        return gguf.LlamaFileType.ALL_F32
    names = {"Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}
    return gguf.LlamaFileType[names.get(type_name, f"MOSTLY_{type_name}")]


def add_vocab(writer: Any, out: Path, vocab_size: int, pads_are_text: bool = False) -> None:
    """As convert_hf_to_gguf.py's _set_vocab_gpt2: tokens, types, then merges/ids via SpecialVocab.
    ``pads_are_text``: the padding tokens are ordinary tokens whose text is their name (a random
    model draws them nearly always: as unused tokens llama.cpp would stream nothing for them)."""
    import gguf

    tokenizer_json = read_json(out / "tokenizer.json")
    tokens = {index: token for token, index in tokenizer_json["model"]["vocab"].items()}
    added = {entry["id"]: entry for entry in tokenizer_json["added_tokens"]}
    tokens |= {index: entry["content"] for index, entry in added.items()}

    token_list: list[str] = []
    token_types: list[int] = []
    for index in range(vocab_size):
        if index not in tokens:
            token_list.append(f"[PAD{index}]")
            token_types.append(gguf.TokenType.NORMAL if pads_are_text else gguf.TokenType.UNUSED)
        elif index in added:
            token_list.append(tokens[index])
            token_types.append(gguf.TokenType.CONTROL if added[index]["special"] else gguf.TokenType.USER_DEFINED)
        else:
            token_list.append(tokens[index])
            token_types.append(gguf.TokenType.NORMAL)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(GGUF_TOKENIZER_PRE)
    writer.add_token_list(token_list)
    writer.add_token_types(token_types)
    gguf.SpecialVocab(out, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


def _gguf_tensors(
    spec: FamilySpec, config: dict[str, Any], tensors: dict[str, np.ndarray]
) -> list[tuple[str, np.ndarray]]:
    """(gguf name, float32 array) in llama.cpp's layout, experts stacked, llama q/k permuted."""
    result: list[tuple[str, np.ndarray]] = []
    if _rope_type(config.get("rope_scaling")) == "llama3":
        result.append(("rope_freqs.weight", llama3_rope_factors(config)))

    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name in sorted(tensors, key=natural_key):
        array = np.ascontiguousarray(tensors[name], dtype=np.float32)
        if name in _GLOBAL_TENSORS:
            result.append((_GLOBAL_TENSORS[name], array))
            continue
        match = _LAYER_RE.fullmatch(name)
        if match is None:
            raise ValueError(f"no GGUF name for tensor {name!r}")
        block, rest = int(match[1]), match[2]
        if expert := _EXPERT_RE.fullmatch(rest):
            experts.setdefault((block, expert[2]), {})[int(expert[1])] = array
            continue
        if rest not in _LAYER_TENSORS:
            raise ValueError(f"no GGUF name for tensor {name!r}")
        if spec.permute_qk and rest in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            array = permute_qk(array, config["num_attention_heads"])
        elif spec.permute_qk and rest in ("self_attn.k_proj.weight", "self_attn.k_proj.bias"):
            array = permute_qk(array, config["num_key_value_heads"])
        result.append((f"blk.{block}.{_LAYER_TENSORS[rest]}", array))

    for (block, projection), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[index] for index in sorted(by_expert)])
        result.append((f"blk.{block}.{_EXPERT_TENSORS[projection]}", stacked))
    return sorted(result, key=lambda item: _gguf_order(item[0]))


def _gguf_order(name: str) -> tuple[Any, ...]:
    if match := re.fullmatch(r"blk\.(\d+)\.(.+)", name):
        return (2, int(match[1]), match[2])
    return ({"rope_freqs.weight": 0, "token_embd.weight": 1, "output_norm.weight": 3}.get(name, 4), 0, name)


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's half-split rotary layout to interleaved pairs."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors for llama3 rope scaling, as llama.cpp's rope_freqs tensor holds them.

    convert_hf_to_gguf.py reads original_max_position_embeddings from the top level of config.json
    (default 8192) rather than from rope_scaling; we use rope_scaling's value, which is the one
    transformers uses, so the GGUF computes the same model as the safetensors.
    """
    scaling = config["rope_scaling"]
    dim = head_dim(config)
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    factors = np.where(
        wavelen < old_context / high,
        1.0,
        np.where(wavelen > old_context / low, factor, 1.0 / ((1.0 - smooth) / factor + smooth)),
    )
    return factors.astype(np.float32)


def load_gguf_with_transformers(out_dir: str | Path, gguf_type: str, **kwargs: Any) -> Any:
    """transformers' model over `model-<TYPE>.gguf`, built with the directory's config.json.

    transformers 5.23 rebuilds these configs from GGUF metadata incompletely (qwen3: no head_dim,
    so 128; qwen3moe: no moe_intermediate_size, so 768; llama: rope scaling dropped), so the
    config is passed in and only the tensors come from the GGUF. Needs `accelerate`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    type_name = gguf_type.strip().upper()
    if type_name not in KQUANT_TYPES:
        (type_name,) = parse_gguf_types(gguf_type)
    config = AutoConfig.from_pretrained(out)
    return AutoModelForCausalLM.from_pretrained(out, gguf_file=f"model-{type_name}.gguf", config=config, **kwargs)


def tensor_type(name: str, array: np.ndarray, requested: Any) -> Any:
    """convert_hf_to_gguf.py's choice: norms, 1-D tensors and the MoE router stay F32, and a row
    length the block size does not divide falls back to F16."""
    import gguf

    F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
    if array.ndim <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name:
        return F32
    block_size, _ = gguf.GGML_QUANT_SIZES[requested]
    if array.shape[-1] % block_size:
        return F16
    return requested


# ---------------------------------------------------------------------------------------------

