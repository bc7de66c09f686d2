"""Small, seeded, random-weight checkpoints for comparing our model code against HF transformers.

`make_checkpoint` writes a HF-style directory (config.json, safetensors, tokenizer, generation
config) for one of the llama / qwen3 / qwen3_moe families and, optionally, GGUF files laid out the
way llama.cpp's convert_hf_to_gguf.py lays them out.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neuron.loader.gguf_file import _GLOBAL, _LAYER

FAMILIES: tuple[str, ...] = ("llama", "qwen3", "qwen3_moe")
CONFIG_STYLES: tuple[str, ...] = ("hub", "rope_parameters")

# What gguf-py 0.19 can quantise itself; the K-quants (Q4_K, Q5_K, Q6_K, ...) only dequantise.
GGUF_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# K-quants that `write_random_kquant_gguf` fills with random, valid blocks (not the checkpoint's
# weights): enough to check that two readers dequantise the same bits the same way.
KQUANT_TYPES: tuple[str, ...] = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
BOS_TOKEN = ENDOFTEXT
EOS_TOKEN = IM_END
PAD_TOKEN = ENDOFTEXT
TARGET_VOCAB_SIZE = 512
GGUF_TOKENIZER_PRE = "qwen2"

# Qwen2's split regex. llama.cpp runs the same one for tokenizer.ggml.pre == "qwen2", so text
# tokenises identically through tokenizer.json and through the GGUF.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

GENERATION_DEFAULTS: dict[str, Any] = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}

_CORPUS = """\
The lighthouse keeper woke before dawn, as he had done every morning for thirty years. He climbed
the spiral stairs, counted the steps out of habit, and checked the lamp. The sea was calm and grey,
and the gulls were already arguing over the harbour. In the small kitchen below, the kettle began to
sing, and the radio spoke quietly about the weather: light winds from the west, rain by the evening.

A user asked the assistant a simple question about the system. The assistant answered that the
system was running normally, that every service had started on time, and that the logs showed no
errors. The user thanked the assistant and asked for a summary of the morning. The assistant wrote
three short sentences and then stopped, because a good answer is often a short one.

Numbers matter in small tests: 1, 2, 3, 10, 42, 100, 256, 512, 1024 and 2048 appear here so that
digits are seen during training. Dates such as 2024-01-15 and times such as 09:30 and 17:45 are also
common. Prices like $3.50 or 12.99 euros, and ratios like 3:2 or 16:9, show up in everyday writing.

The village market opened at eight. Farmers brought apples, pears, potatoes, onions and fresh bread.
Children ran between the stalls while their parents talked about the harvest, the price of grain and
the new road that would connect the village to the city. Nobody was in a hurry; the day was long and
the sun was warm, and there would be time enough for everything that needed to be done.

Engineers who build inference servers care about latency, throughput and correctness. They measure
the time to the first token, the number of tokens generated per second, and whether the output of
the model matches a trusted reference. When the numbers disagree, they read the code again, slowly,
and look for the one line where the order of the heads, the scale of the rotary embedding, or the
shape of a weight matrix was not what they expected.

Quiet rivers flow through green valleys toward the open sea. Along the banks, tall trees lean over
the water, and their leaves turn gold and red in autumn. In winter, the river freezes at the edges,
and in spring it rises with melted snow from the mountains. Summer brings swimmers, boats and long
evenings of light.
"""


@dataclass(frozen=True)
class _Family:
    model_type: str
    hf_class: str
    gguf_arch: str
    # llama.cpp reorders q/k rows only for its "llama" arch (convert_hf_to_gguf.py LlamaModel.permute).
    permute_qk: bool


_FAMILY_SPECS: dict[str, _Family] = {
    "llama": _Family("llama", "LlamaForCausalLM", "llama", True),
    "qwen3": _Family("qwen3", "Qwen3ForCausalLM", "qwen3", False),
    "qwen3_moe": _Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe", False),
}


def make_checkpoint(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    shards: int = 1,
    config_style: str = "hub",
    gguf_types: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of `family` into `out_dir` and return that directory.

    `overrides` update the config dict (hub form: `rope_theta` / `rope_scaling` at top level;
    `rope_parameters` is also accepted). `gguf_types` is a comma-separated list such as "F32,Q8_0";
    each one adds `model-<TYPE>.gguf`.
    """
    spec = _family(family)
    if config_style not in CONFIG_STYLES:
        raise ValueError(f"config_style must be one of {CONFIG_STYLES}, got {config_style!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    requested_gguf = parse_gguf_types(gguf_types)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    token_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = tiny_config(family, vocab_size=tokenizer.get_vocab_size(), **overrides)
    config.update(
        bos_token_id=token_ids[BOS_TOKEN], eos_token_id=token_ids[EOS_TOKEN], pad_token_id=token_ids[PAD_TOKEN]
    )
    _validate_config(config)

    model = build_model(spec, config, seed)
    _save_weights(model, out, shards)
    _write_json(out / "config.json", restyle_config(_read_json(out / "config.json"), config_style))
    _check_config_loads(out, model.config)
    write_tokenizer(out, tokenizer, config)
    _write_json(out / "generation_config.json", generation_config(config))
    for gguf_type in requested_gguf:
        write_gguf(out, gguf_type)
    return out


def parse_gguf_types(gguf_types: str | None) -> list[str]:
    if not gguf_types:
        return []
    names = [name.strip().upper() for name in gguf_types.split(",") if name.strip()]
    unsupported = [name for name in names if name not in GGUF_TYPES]
    if unsupported:
        raise ValueError(f"gguf-py cannot write {unsupported}; supported: {list(GGUF_TYPES)}")
    return list(dict.fromkeys(names))


def _family(family: str) -> _Family:
    if family not in _FAMILY_SPECS:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return _FAMILY_SPECS[family]


# ---------------------------------------------------------------------------------------------
# config


def tiny_config(family: str, *, vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """The family's tiny config in hub form, with `overrides` applied."""
    spec = _family(family)
    config: dict[str, Any] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "max_position_embeddings": 256,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_cache": True,
    }
    if family == "llama":
        config |= {
            "num_key_value_heads": 2,
            "head_dim": 8,
            "rms_norm_eps": 1e-5,
            "mlp_bias": False,
            # 10000 with head_dim 8 puts one frequency in each llama3 band (kept, smoothed, scaled).
            "rope_theta": 10000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": True,
        }
    else:
        config |= {
            "num_key_value_heads": 4 if family == "qwen3" else 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
        }
    if family == "qwen3_moe":
        config |= {
            "num_hidden_layers": 2,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    config.update(copy.deepcopy(overrides))  # transformers edits rope dicts in place; keep the caller's
    return _to_hub_rope(config)


def _to_hub_rope(config: dict[str, Any]) -> dict[str, Any]:
    rope = config.pop("rope_parameters", None)
    if rope is None:
        return config
    rope = dict(rope)
    config["rope_theta"] = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    return config


def _validate_config(config: dict[str, Any]) -> None:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if _head_dim(config) % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {_head_dim(config)}")


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def restyle_config(saved: dict[str, Any], style: str) -> dict[str, Any]:
    """Rewrite a config.json dict (as transformers saved it) into `style`."""
    config = dict(saved)
    rope = dict(config.pop("rope_parameters", None) or {})
    config.pop("rope_theta", None)
    config.pop("rope_scaling", None)
    if style == "rope_parameters":
        config["rope_parameters"] = rope
        return config
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    # Hub configs predate these transformers-5 renames.
    if "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    return config


def _check_config_loads(out: Path, expected: Any) -> None:
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(out)
    keys = ("rope_parameters", "vocab_size", "num_key_value_heads", "head_dim", "num_local_experts",
            "tie_word_embeddings", "eos_token_id")
    for key in keys:
        want, got = getattr(expected, key, None), getattr(loaded, key, None)
        if want != got:
            raise RuntimeError(f"transformers reads {key}={got!r} from {out / 'config.json'}, expected {want!r}")


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        **GENERATION_DEFAULTS,
    }


# ---------------------------------------------------------------------------------------------
# weights


def build_model(spec: _Family, config: dict[str, Any], seed: int) -> Any:
    import torch
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = getattr(transformers, spec.hf_class)(hf_config).to(torch.float32).eval()
    _reinit(model, seed)
    return model


def _reinit(model: Any, seed: int) -> None:
    """Replace the default init (std 0.02, norms at 1) with one that gives non-flat logits."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)


def _save_weights(model: Any, out: Path, shards: int) -> None:
    stale_files = [*out.glob("model*.safetensors"), *out.glob("model-*.gguf"), out / "model.safetensors.index.json"]
    for stale in stale_files:
        stale.unlink(missing_ok=True)
    # One file first, so the tensors on disk are exactly what save_pretrained writes (tied
    # weights dropped, fused MoE experts split back into per-expert tensors).
    model.save_pretrained(out, safe_serialization=True, max_shard_size="100GB")
    if shards > 1:
        _split_into_shards(out, shards)


def _split_into_shards(out: Path, shards: int) -> None:
    from safetensors import safe_open
    from safetensors.numpy import save_file

    single = out / "model.safetensors"
    with safe_open(single, framework="np") as handle:
        names = sorted(handle.keys(), key=_natural_key)
        tensors = {name: handle.get_tensor(name) for name in names}
    if shards > len(names):
        raise ValueError(f"cannot split {len(names)} tensors into {shards} shards")

    groups = _balanced_groups([tensors[name].nbytes for name in names], shards)
    weight_map: dict[str, str] = {}
    for index, (start, stop) in enumerate(groups, start=1):
        filename = f"model-{index:05d}-of-{shards:05d}.safetensors"
        save_file({name: tensors[name] for name in names[start:stop]}, out / filename, metadata={"format": "pt"})
        weight_map |= {name: filename for name in names[start:stop]}
    single.unlink()
    index_json = {
        "metadata": {
            "total_parameters": int(sum(t.size for t in tensors.values())),
            "total_size": int(sum(t.nbytes for t in tensors.values())),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(out / "model.safetensors.index.json", index_json)


def _balanced_groups(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous, non-empty [start, stop) ranges with roughly equal byte totals."""
    total = sum(sizes)
    cumulative = np.cumsum([0, *sizes])
    cuts = [0]
    for part in range(1, parts):
        cut = int(np.searchsorted(cumulative, total * part / parts))
        cut = max(cut, cuts[-1] + 1)
        cut = min(cut, len(sizes) - (parts - part))
        cuts.append(cut)
    cuts.append(len(sizes))
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def read_safetensors(out: Path) -> dict[str, np.ndarray]:
    """All tensors of the checkpoint in `out`, sharded or not."""
    from safetensors import safe_open

    index = out / "model.safetensors.index.json"
    files = sorted(set(_read_json(index)["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors: dict[str, np.ndarray] = {}
    for filename in files:
        with safe_open(out / filename, framework="np") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
    return tensors


# ---------------------------------------------------------------------------------------------
# tokenizer


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained on the built-in corpus; the specials get the last ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return tokenizer


def write_tokenizer(out: Path, tokenizer: Any, config: dict[str, Any]) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": config["max_position_embeddings"],
        "pad_token": PAD_TOKEN,
        # PreTrainedTokenizerFast here makes transformers drop the GGUF's special tokens and chat
        # template when a GGUF in this directory is loaded with AutoTokenizer(..., gguf_file=...).
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)


# ---------------------------------------------------------------------------------------------
# GGUF

# The same HF -> GGUF names the loader reads (llama.cpp's convert_hf_to_gguf.py layout).
_GLOBAL_TENSORS = {k: v for k, v in _GLOBAL.items() if k != "rope_freqs"}
_LAYER_TENSORS = {k: v for k, v in _LAYER.items() if not k.startswith("mlp.experts.")}
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
}


def random_quant_blocks(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bytes for a tensor of logical `shape` (last dim a multiple of the block size) in the
    K-quant `type_name`, as GGUFWriter.add_tensor(..., raw_dtype=...) takes them: uint8, the last
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

    config = _to_hub_rope(_hub_names(_read_json(out / "config.json")))
    spec = _family(_family_of(config["model_type"]))
    qtype = gguf.GGMLQuantizationType[type_name]
    path = out / f"model-{type_name}.gguf"

    writer = gguf.GGUFWriter(path, spec.gguf_arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"neuron-tiny-{config['model_type']}")
    _add_hparams(writer, spec, config)
    writer.add_file_type(_file_type(type_name))
    _add_vocab(writer, out, config["vocab_size"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, array in _gguf_tensors(spec, config, read_safetensors(out)):
        tensor_type = _tensor_type(name, array, qtype)
        if rng is not None and tensor_type == qtype:
            data = random_quant_blocks(type_name, array.shape, rng)
        else:
            data = gguf.quants.quantize(array, tensor_type)
        writer.add_tensor(name, data, raw_dtype=tensor_type)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return path


def _family_of(model_type: str) -> str:
    return next(family for family, spec in _FAMILY_SPECS.items() if spec.model_type == model_type)


def _hub_names(config: dict[str, Any]) -> dict[str, Any]:
    config = dict(config)
    if "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")
    return config


def _add_hparams(writer: Any, spec: _Family, config: dict[str, Any]) -> None:
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
        writer.add_rope_dimension_count(_head_dim(config))


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


def _file_type(type_name: str) -> int:
    import gguf

    if type_name == "F32":
        return gguf.LlamaFileType.ALL_F32
    names = {"Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}
    return gguf.LlamaFileType[names.get(type_name, f"MOSTLY_{type_name}")]


def _add_vocab(writer: Any, out: Path, vocab_size: int) -> None:
    """As convert_hf_to_gguf.py's _set_vocab_gpt2: tokens, types, then merges/ids via SpecialVocab."""
    import gguf

    tokenizer_json = _read_json(out / "tokenizer.json")
    tokens = {index: token for token, index in tokenizer_json["model"]["vocab"].items()}
    added = {entry["id"]: entry for entry in tokenizer_json["added_tokens"]}
    tokens |= {index: entry["content"] for index, entry in added.items()}

    token_list: list[str] = []
    token_types: list[int] = []
    for index in range(vocab_size):
        if index not in tokens:
            token_list.append(f"[PAD{index}]")
            token_types.append(gguf.TokenType.UNUSED)
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
    spec: _Family, config: dict[str, Any], tensors: dict[str, np.ndarray]
) -> list[tuple[str, np.ndarray]]:
    """(gguf name, float32 array) in llama.cpp's layout, experts stacked, llama q/k permuted."""
    result: list[tuple[str, np.ndarray]] = []
    if _rope_type(config.get("rope_scaling")) == "llama3":
        result.append(("rope_freqs.weight", llama3_rope_factors(config)))

    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name in sorted(tensors, key=_natural_key):
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
    dim = _head_dim(config)
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


def _tensor_type(name: str, array: np.ndarray, requested: Any) -> Any:
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


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Checkpoints of a real shape, for speed measurements

# The shape sets the speed, not the values (PERF.md). Hub-style llama / qwen3 configs.
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                  "tie_word_embeddings": False},
    "llama3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                    "tie_word_embeddings": True},
    "qwen3-tiny": {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
                   "tie_word_embeddings": False},  # for trying the measurement scripts on a CPU
    "qwen3-8b": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "tie_word_embeddings": False},
}


def make_shaped_checkpoint(shape: str, out_dir: str | Path, *, device: str = "cpu", dtype: str = "bfloat16",
                           seed: int = 0) -> Path:
    """Write a random-weight safetensors checkpoint of a real model shape (one file per layer),
    tensor by tensor on `device`, without building the model. The tokenizer is the tiny test one:
    most generated ids have no text, so measure with ``return_token_ids``."""
    import torch
    from safetensors.torch import save_file

    shaped = dict(SHAPES[shape])
    model_type = shaped.pop("model_type")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = tiny_config(model_type, vocab_size=shaped["vocab_size"])
    config |= shaped | {"max_position_embeddings": 8192, "torch_dtype": dtype, "bos_token_id": ids[BOS_TOKEN],
                        "eos_token_id": ids[EOS_TOKEN], "pad_token_id": ids[PAD_TOKEN]}
    if model_type == "llama":
        config |= {"head_dim": config["hidden_size"] // config["num_attention_heads"], "rope_theta": 500000.0,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    h, hd, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    nq, nkv, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    gen = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = getattr(torch, dtype)

    def rand(*shape_: int) -> Any:
        return (torch.randn(*shape_, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch_dtype).cpu()

    def ones(n: int) -> Any:
        return torch.ones(n, dtype=torch_dtype)

    files: dict[str, dict[str, Any]] = {"model-embed.safetensors": {"model.embed_tokens.weight": rand(vocab, h),
                                                                    "model.norm.weight": ones(h)}}
    if not config["tie_word_embeddings"]:
        files["model-embed.safetensors"]["lm_head.weight"] = rand(vocab, h)
    index: dict[str, str] = {}
    for name, tensors in files.items():
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index |= dict.fromkeys(tensors, name)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors = {p + "self_attn.q_proj.weight": rand(nq * hd, h), p + "self_attn.k_proj.weight": rand(nkv * hd, h),
                   p + "self_attn.v_proj.weight": rand(nkv * hd, h), p + "self_attn.o_proj.weight": rand(h, nq * hd),
                   p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                   p + "mlp.down_proj.weight": rand(h, inter), p + "input_layernorm.weight": ones(h),
                   p + "post_attention_layernorm.weight": ones(h)}
        if model_type == "qwen3":
            tensors |= {p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd)}
        name = f"model-layer{i:03d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index |= dict.fromkeys(tensors, name)
    _write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": index})
    _write_json(out / "config.json", config)
    write_tokenizer(out, tokenizer, config)
    _write_json(out / "generation_config.json", generation_config(config))
    return out
