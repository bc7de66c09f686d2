"""Reading a model's architecture into ``protocol.ModelConfig``, from a Hugging Face
``config.json`` (hub style or ``rope_parameters`` style) or from GGUF metadata."""

from __future__ import annotations

import re
from typing import Any

from protocol import ModelConfig

from neuron.models import families
from neuron.models.families.common import clean_scaling

from neuron.errors import BadModelConfig, UnsupportedModel

_GGUF_ARCH = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}


# The largest count of each kind a config may give (the largest published models are far below):
# a count is checked against these and against the tensors before anything is built from it.
COUNT_LIMITS = {"num_layers": 4096, "hidden_size": 1 << 17, "vocab_size": 1 << 22, "num_heads": 4096,
                "num_kv_heads": 4096, "head_dim": 8192, "intermediate_size": 1 << 20, "num_experts": 4096,
                "num_experts_per_tok": 4096, "moe_intermediate_size": 1 << 20}
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d{1,9})\.")


def check_counts(cfg: ModelConfig, tensor_names, described_by: str,
                 embedding: tuple[int, ...] | None = None) -> None:
    """Every count in range, no more layers than the weights hold, and the token embedding
    (``embedding``: its shape, where the files hold one) of vocab_size x hidden_size: a config that
    claims a million layers is refused here, not after a million layers' tensor names were
    listed."""
    for name, limit in COUNT_LIMITS.items():
        value = getattr(cfg, name)
        if not 0 <= value <= limit:
            raise BadModelConfig(f"{described_by}: {name} = {value} is out of range (0..{limit})")
    for name in ("num_layers", "hidden_size", "vocab_size", "num_heads", "head_dim"):
        if getattr(cfg, name) < 1:
            raise BadModelConfig(f"{described_by}: {name} must be at least 1")
    present = max((int(m.group(1)) for n in tensor_names if (m := _LAYER_INDEX.search(n))), default=-1) + 1
    if cfg.num_layers > present:
        raise BadModelConfig(f"{described_by} gives {cfg.num_layers} layers; the weights hold {present}")
    if embedding is not None and tuple(embedding) != (cfg.vocab_size, cfg.hidden_size):
        raise BadModelConfig(f"{described_by} gives a vocabulary of {cfg.vocab_size} and a hidden size of "
                             f"{cfg.hidden_size}; the token embedding is {' x '.join(map(str, embedding))}")
    if len(cfg.layer_types) not in (0, cfg.num_layers):
        raise BadModelConfig(f"{described_by} gives {len(cfg.layer_types)} layer types for {cfg.num_layers} layers")


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """The architecture of a config.json, read by the family that serves its ``model_type``."""
    model_type = raw.get("model_type")
    served = ", ".join(families.supported())
    if model_type is None:
        raise UnsupportedModel(f"config.json has no model_type (supported: {served})")
    family = families.family(str(model_type))
    if family is None:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported (supported: {served})")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    return family.config_from_hf(raw, text)


def config_from_gguf(fields: dict[str, Any], tensor_names: set[str], n_tokens: int) -> ModelConfig:
    arch = fields.get("general.architecture")
    family = _GGUF_ARCH.get(str(arch))
    own = families.gguf_family(str(arch))
    if own is not None:
        return own.config_from_gguf(str(arch), fields, tensor_names, n_tokens)
    if family is None:
        served = ", ".join([*_GGUF_ARCH, *families.GGUF_BUILT_IN])
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported (supported: {served})")

    def key(name: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise BadModelConfig(f"GGUF metadata lacks {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    scaling = None
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind and kind != "none":
        scaling = {"rope_type": str(kind), "factor": float(key("rope.scaling.factor", 1.0))}
        if fields.get(f"{arch}.rope.scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = int(fields[f"{arch}.rope.scaling.original_context_length"])
        for name in ("beta_fast", "beta_slow"):
            if fields.get(f"{arch}.rope.scaling.yarn_{name}") is not None:
                scaling[name] = float(fields[f"{arch}.rope.scaling.yarn_{name}"])
        scaling = clean_scaling(scaling)
    return ModelConfig(
        family=family,
        vocab_size=int(fields.get(f"{arch}.vocab_size") or n_tokens),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", 0)),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(fields.get(f"{arch}.attention.key_length") or hidden // heads),
        # GGUF stores float32: 1e-5 comes back as 9.99999974e-06; keep the value config.json had
        rms_norm_eps=float(f"{float(key('attention.layer_norm_rms_epsilon', 1e-6)):.7g}"),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=scaling,
        qk_norm=family != "llama",
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        num_experts=int(fields.get(f"{arch}.expert_count", 0)),
        num_experts_per_tok=int(fields.get(f"{arch}.expert_used_count", 0)),
        moe_intermediate_size=int(fields.get(f"{arch}.expert_feed_forward_length", 0)),
        norm_topk_prob=True,
    )


def required_tensors(cfg: ModelConfig) -> list[str]:
    """The Hugging Face tensor names a checkpoint of ``cfg`` must hold (its family says which)."""
    family = families.family(cfg.family)
    if family is None:
        raise UnsupportedModel(f"model family {cfg.family!r} is not supported")
    return family.required_tensors(cfg)


def missing_tensors(cfg: ModelConfig, present: set[str] | frozenset[str]) -> list[str]:
    missing = []
    for name in required_tensors(cfg):
        if name.endswith(".experts.*"):
            prefix = name[:-1]
            fused = {prefix + "gate_up_proj", prefix + "down_proj"} <= present
            split = all(f"{prefix}{e}.{x}_proj.weight" in present
                        for e in range(cfg.num_experts) for x in ("gate", "up", "down"))
            if not (fused or split):
                missing.append(prefix + "{0..%d}.{gate,up,down}_proj.weight" % (cfg.num_experts - 1))
        elif name not in present:
            missing.append(name)
    return missing
