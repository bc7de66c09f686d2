"""Reading a model's architecture into ``protocol.ModelConfig``, from a Hugging Face
``config.json`` (hub style or ``rope_parameters`` style) or from GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from protocol import ModelConfig

from .errors import BadModelConfig, UnsupportedModel

SUPPORTED = ("llama", "qwen3", "qwen3_moe")
ROPE_SCALINGS = ("linear", "llama3", "yarn")  # what neuron.models.layers.rope_inv_freq computes
_GGUF_ARCH = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}


def read_config_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadModelConfig(f"{path.name} does not parse: {exc}") from None
    if not isinstance(raw, dict):
        raise BadModelConfig(f"{path.name} is not a JSON object")
    return raw


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type is None:
        raise UnsupportedModel(f"config.json has no model_type (supported: {', '.join(SUPPORTED)})")
    if model_type not in SUPPORTED:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    act = text.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (supported: silu)")
    if text.get("use_sliding_window"):
        raise UnsupportedModel("sliding-window attention (use_sliding_window: true) is not supported")
    try:
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        rope = text.get("rope_parameters") or {}
        scaling = text.get("rope_scaling")
        if rope and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        return ModelConfig(
            family=model_type,
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size") or text.get("moe_intermediate_size") or 0),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            rope_scaling=_clean_scaling(scaling),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            attention_bias=bool(text.get("attention_bias", False)),
            # transformers 5 saves ``num_local_experts``; hub configs say ``num_experts``
            num_experts=_experts(text) if model_type == "qwen3_moe" else 0,
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0)),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=int(text.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=[int(x) for x in text.get("mlp_only_layers") or []],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadModelConfig(f"config.json is missing or has a bad value: {exc}") from None


def _experts(text: dict[str, Any]) -> int:
    count = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    if count < 1:
        raise BadModelConfig("a qwen3_moe config.json needs num_experts (or num_local_experts)")
    return count


def _clean_scaling(scaling: Any) -> dict[str, float | str | int] | None:
    if not isinstance(scaling, dict):
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALINGS:
        raise UnsupportedModel(f"rope scaling {kind!r} is not supported (supported: default, {', '.join(ROPE_SCALINGS)})")
    out = {k: v for k, v in scaling.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    out["rope_type"] = str(kind)
    return out


def config_from_gguf(fields: dict[str, Any], tensor_names: set[str], n_tokens: int) -> ModelConfig:
    arch = fields.get("general.architecture")
    family = _GGUF_ARCH.get(str(arch))
    if family is None:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_GGUF_ARCH)})")

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
        scaling = _clean_scaling(scaling)
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
    """The Hugging Face tensor names a checkpoint of ``cfg`` must hold. (An untied model
    without ``lm_head.weight`` reuses the embedding, so the LM head is not required.) MoE
    experts may be stored per expert or fused; ``experts.*`` names stand for either."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"]
        if cfg.attention_bias:
            names += [f"{p}.self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        sparse = cfg.num_experts > 0 and i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0
        if sparse:
            names += [f"{p}.mlp.gate.weight", f"{p}.mlp.experts.*"]
        else:
            names += [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


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
