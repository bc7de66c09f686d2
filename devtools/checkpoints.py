"""Small, seeded, random-weight checkpoints for comparing our model code against HF transformers.

`make_checkpoint` writes a HF-style directory (config.json, safetensors, tokenizer, generation
config) for one of the llama / qwen3 / qwen3_moe families and, optionally, GGUF files laid out the
way llama.cpp's convert_hf_to_gguf.py lays them out (``gguf_writer``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np

from .families import (CONFIG_STYLES, FAMILIES, FamilySpec, family_spec, head_dim, natural_key, read_json,  # noqa: F401
                       read_safetensors, to_hub_rope, write_json)
from .fixture_tokenizer import (BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS,  # noqa: F401
                                build_tokenizer, write_tokenizer)
from .gguf_writer import (GGUF_TYPES, KQUANT_TYPES, load_gguf_with_transformers, parse_gguf_types,  # noqa: F401
                          random_quant_blocks, write_gguf, write_random_kquant_gguf)

GENERATION_DEFAULTS: dict[str, Any] = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}


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
    spec = family_spec(family)
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
    write_json(out / "config.json", restyle_config(read_json(out / "config.json"), config_style))
    _check_config_loads(out, model.config)
    write_tokenizer(out, tokenizer, config)
    write_json(out / "generation_config.json", generation_config(config))
    for gguf_type in requested_gguf:
        write_gguf(out, gguf_type)
    return out


# ---------------------------------------------------------------------------------------------
# config


def tiny_config(family: str, *, vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """The family's tiny config in hub form, with `overrides` applied."""
    spec = family_spec(family)
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
    return to_hub_rope(config)


def _validate_config(config: dict[str, Any]) -> None:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if head_dim(config) % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim(config)}")


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


def build_model(spec: FamilySpec, config: dict[str, Any], seed: int) -> Any:
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
        names = sorted(handle.keys(), key=natural_key)
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
    write_json(out / "model.safetensors.index.json", index_json)


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



