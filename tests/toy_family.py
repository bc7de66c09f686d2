"""A throwaway model family for tests (served through ``NEURON_FAMILIES=toy_family``): llama
attention layers beside layers that keep a fixed-size state per sequence, a toy recurrence

    s_t = sigmoid(decay) * s_{t-1} + W_in x_t,    y_t = W_out s_t,

each layer followed by llama's MLP. It exists to prove the family seam and per-layer state: the
runner allocates its state slots, the leader hands them out and preemption frees them.
``config.json``: ``model_type`` "toy_recurrent", llama's sizes, and ``layer_types`` (each
"attention" or "recurrent"). Importing this module imports no torch (the leader reads it)."""

from __future__ import annotations

from typing import Any

from protocol import ModelConfig

from neuron.errors import BadModelConfig, UnsupportedModel
from neuron.models.sharding import ShardingError

MODEL_TYPES = ("toy_recurrent",)
KINDS = ("attention", "recurrent")


def config_from_hf(raw: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
    kinds = list(text.get("layer_types") or [])
    if not kinds or any(k not in KINDS for k in kinds):
        raise UnsupportedModel(f"layer_types must list {' or '.join(KINDS)} for each layer")
    try:
        heads = int(text["num_attention_heads"])
        return ModelConfig(
            family="toy_recurrent", vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]), num_layers=len(kinds), num_heads=heads,
            num_kv_heads=heads, head_dim=int(text["hidden_size"]) // heads,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope_theta=float(text.get("rope_theta", 10000.0)),
            max_position_embeddings=int(text.get("max_position_embeddings", 2048)), tie_word_embeddings=True,
            layer_types=kinds)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadModelConfig(f"config.json is missing or has a bad value: {exc}") from None


def required_tensors(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if kind == "attention":
            names += [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"]
        else:
            names += [f"{p}.mixer.in_proj.weight", f"{p}.mixer.out_proj.weight", f"{p}.mixer.decay"]
    return names


def check_split(cfg: ModelConfig, world: int, block: int = 1) -> None:
    if world != 1:
        raise ShardingError("the toy recurrent family runs on one rank")


def build(cfg: ModelConfig, world: int, rank: int, src, *, dtype, device, max_len: int, block: int = 1):
    from toy_model import ToyRecurrentLM

    check_split(cfg, world)
    return ToyRecurrentLM(cfg, src, dtype=dtype, device=device, max_len=max_len)
