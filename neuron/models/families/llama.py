"""The llama family: llama 1/2/3, qwen3 (q/k norm) and qwen3_moe (sparse experts). Its model is
``neuron.models.llama.CausalLM``; its split over ranks is ``neuron.models.sharding``."""

from __future__ import annotations

from typing import Any

from protocol import ModelConfig

from neuron.errors import BadModelConfig, UnsupportedModel

from ..sharding import check_plan, sparse_layer
from .common import rope_of

MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")


def config_from_hf(raw: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
    model_type = raw["model_type"]
    act = text.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (supported: silu)")
    if text.get("use_sliding_window"):
        raise UnsupportedModel("sliding-window attention (use_sliding_window: true) is not supported")
    try:
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        theta, scaling = rope_of(text)
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
            rope_scaling=scaling,
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


def required_tensors(cfg: ModelConfig) -> list[str]:
    """An untied model without ``lm_head.weight`` reuses the embedding, so the LM head is not
    required. MoE experts may be stored per expert or fused; ``experts.*`` names stand for either."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"]
        if cfg.attention_bias:
            names += [f"{p}.self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        if sparse_layer(cfg, i):
            names += [f"{p}.mlp.gate.weight", f"{p}.mlp.experts.*"]
        else:
            names += [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


def check_split(cfg: ModelConfig, world: int, block: int = 1) -> None:
    check_plan(cfg, world, block)


# Its layers split into pipeline stages (``build``'s ``stage``).
PIPELINE = True


def build(cfg: ModelConfig, world: int, rank: int, src, *, dtype, device, max_len: int, block: int = 1,
          stage=None):
    from ..llama import CausalLM
    from ..sharding import plan_shard

    return CausalLM(cfg, plan_shard(cfg, world, rank, block), src, dtype=dtype, device=device, max_len=max_len,
                    stage=stage)
