"""The hybrid family: Qwen3-Next (``qwen3_next``: fused ``in_proj_qkvz``/``in_proj_ba``, sparse
experts with a shared expert) and Qwen3.5's text models (``qwen3_5_text``: separate projections,
dense MLP; ``qwen3_5_moe_text``: the same with sparse and shared experts), also as the hub
publishes Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``: the text model's config under ``text_config``, its
tensors under ``model.language_model.``, beside a vision tower that waits for image support).
Gated DeltaNet layers beside gated full attention (``neuron.models.hybrid``)."""

from __future__ import annotations

from typing import Any

import msgspec

from protocol import ModelConfig

from neuron.errors import BadModelConfig, UnsupportedModel

from ..sharding import ShardingError, check_plan, sparse_layer

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
# llama.cpp's names, and the model_type each GGUF architecture is.
GGUF_ARCHS = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}
WITH_EXPERTS = ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
NESTED = ("qwen3_5", "qwen3_5_moe")  # text_config, and the text model's tensors under this prefix:
NESTED_PREFIX = "model.language_model"
KINDS = ("linear_attention", "full_attention")
LINEAR = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim")


def _layer_types(text: dict[str, Any], layers: int) -> list[str]:
    kinds = text.get("layer_types")
    if kinds is None:
        every = int(text.get("full_attention_interval", 4))
        kinds = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    kinds = list(kinds)
    if len(kinds) != layers or any(k not in KINDS for k in kinds):
        raise BadModelConfig(f"layer_types must name {' or '.join(KINDS)} for each of the {layers} layers")
    if "full_attention" not in kinds:
        raise UnsupportedModel("a hybrid model without a full-attention layer is not supported")
    return kinds


def config_from_hf(raw: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
    model_type = raw["model_type"]
    if text.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedModel(f"hidden_act {text.get('hidden_act')!r} is not supported (supported: silu)")
    if text.get("attention_bias"):
        raise UnsupportedModel("attention_bias is not supported for the hybrid family")
    rope = dict(text.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default" or text.get("rope_scaling"):
        raise UnsupportedModel(f"rope type {rope.get('rope_type')!r} is not supported for the hybrid family")
    _check_sizes(text)
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        extra: dict[str, int | float | str | bool | list[int]] = {k: int(text[k]) for k in LINEAR}
        extra["prefix"] = NESTED_PREFIX if model_type in NESTED else "model"
        # Qwen3-Next's checkpoints fuse q, k, v, z and b, a into two projections per layer.
        extra["fused_projections"] = model_type == "qwen3_next"
        extra["partial_rotary_factor"] = float(rope.get("partial_rotary_factor",
                                                        text.get("partial_rotary_factor", 0.25)))
        experts = int(text.get("num_experts") or 0) if model_type in WITH_EXPERTS else 0
        # The multi-token-prediction layers beside the model (``mtp.*``), a drafter for
        # speculative decoding; with their own embedding where the config says so.
        extra["mtp_layers"] = int(text.get("mtp_num_hidden_layers") or 0)
        extra["mtp_own_embedding"] = bool(text.get("mtp_use_dedicated_embeddings", False))
        if experts:
            extra["shared_expert_intermediate_size"] = int(text.get("shared_expert_intermediate_size") or 0)
        _check_rotary(int(text.get("head_dim") or hidden // heads), float(extra["partial_rotary_factor"]))
        return ModelConfig(
            family=model_type,
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size") or 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            qk_norm=True,
            num_experts=experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0) if experts else 0,
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=int(text.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=[int(x) for x in text.get("mlp_only_layers") or []],
            layer_types=_layer_types(text, layers),
            extra=extra,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadModelConfig(f"config.json is missing or has a bad value: {exc}") from None


def config_from_gguf(arch: str, fields: dict[str, Any], tensor_names: set[str], n_tokens: int) -> ModelConfig:
    """llama.cpp's metadata of a hybrid model (its converter's Qwen3NextModel, Qwen3_5TextModel,
    Qwen3_5MoeTextModel) as the config.json it came from. Its multi-token-prediction blocks
    (``nextn_predict_layers``, after the others) are not read."""

    def key(name: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise BadModelConfig(f"GGUF metadata lacks {arch}.{name}")
        return value

    layers = int(key("block_count")) - int(fields.get(f"{arch}.nextn_predict_layers", 0) or 0)
    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
    value_heads = int(key("ssm.time_step_rank"))
    interval = int(key("full_attention_interval", 4))
    text: dict[str, Any] = {
        "vocab_size": int(fields.get(f"{arch}.vocab_size") or n_tokens), "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", 0)), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim, "rms_norm_eps": float(f"{float(key('attention.layer_norm_rms_epsilon', 1e-6)):.7g}"),
        "max_position_embeddings": int(key("context_length", 4096)),
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")), "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_num_key_heads": int(key("ssm.group_count")), "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(key("ssm.inner_size")) // max(value_heads, 1),
        "full_attention_interval": interval,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0)),
                            "partial_rotary_factor": int(key("rope.dimension_count", head_dim // 4)) / head_dim},
        "num_experts": int(fields.get(f"{arch}.expert_count", 0) or 0),
        "num_experts_per_tok": int(fields.get(f"{arch}.expert_used_count", 0) or 0),
        "moe_intermediate_size": int(fields.get(f"{arch}.expert_feed_forward_length", 0) or 0),
        "shared_expert_intermediate_size": int(fields.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0),
    }
    if text["num_experts"]:  # a layer without a router has a dense MLP
        text["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    model_type = GGUF_ARCHS[arch]
    cfg = config_from_hf({"model_type": model_type, "tie_word_embeddings": "output.weight" not in tensor_names}, text)
    extra = dict(cfg.extra) | {"fused_projections": False}  # the GGUF holds them split (gguf_hybrid)
    return msgspec.structs.replace(cfg, extra=extra)


def _size(text: dict[str, Any], key: str, least: int = 1) -> int | None:
    """``text[key]`` as an integer of at least ``least`` (None where absent), or BadModelConfig."""
    value = text.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < least:
        raise BadModelConfig(f"{key} must be {'a positive' if least else 'a'} integer, not {value!r}")
    return int(value)


def _check_sizes(text: dict[str, Any]) -> None:
    """Sizes the layers can be built from, or BadModelConfig naming the field."""
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", *LINEAR):
        if _size(text, key) is None:
            raise BadModelConfig(f"config.json lacks {key}")
    _size(text, "head_dim")
    _size(text, "num_key_value_heads")
    _size(text, "intermediate_size", least=0)
    if int(text["linear_num_value_heads"]) % int(text["linear_num_key_heads"]):
        raise BadModelConfig("linear_num_value_heads must be a multiple of linear_num_key_heads")


def _check_rotary(head_dim: int, factor: float) -> None:
    rot = int(head_dim * factor)
    if head_dim < 2 or head_dim % 2 or not 0 < factor <= 1 or rot < 2 or rot % 2:
        raise BadModelConfig(f"partial_rotary_factor {factor} of head_dim {head_dim} must rotate an even number of "
                             "dimensions, at least 2 and at most head_dim")


def required_tensors(cfg: ModelConfig) -> list[str]:
    prefix = str(cfg.extra.get("prefix", "model"))
    names = [f"{prefix}.embed_tokens.weight", f"{prefix}.norm.weight"]
    fused = bool(cfg.extra.get("fused_projections", cfg.family == "qwen3_next"))
    for i, kind in enumerate(cfg.layer_types):
        p = f"{prefix}.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        if kind == "full_attention":
            names += [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"]
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        else:
            la = f"{p}.linear_attn"
            names += [f"{la}.{x}" for x in ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")]
            names += ([f"{la}.in_proj_qkvz.weight", f"{la}.in_proj_ba.weight"] if fused
                      else [f"{la}.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")])
        if sparse_layer(cfg, i):
            names += [f"{p}.mlp.gate.weight", f"{p}.mlp.experts.*"]
            if cfg.extra.get("shared_expert_intermediate_size"):
                names += [f"{p}.mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")]
                names += [f"{p}.mlp.shared_expert_gate.weight"]
        else:
            names += [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


def check_split(cfg: ModelConfig, world: int, block: int = 1) -> None:
    """Full attention, MLPs and experts split as the llama family's; linear attention by whole key
    heads, so not over more ranks than it has key heads; packed weights split the linear
    attention's output projection only on whole quant groups."""
    check_plan(cfg, world, block)
    nk, hv = int(cfg.extra["linear_num_key_heads"]), int(cfg.extra["linear_value_head_dim"])
    if world > nk:
        raise ShardingError(f"tensor_parallel={world} is more ranks than the model's {nk} linear-attention key heads")
    r = int(cfg.extra["linear_num_value_heads"]) // nk
    if block > 1 and world > 1 and (r * hv) % block:
        raise ShardingError(f"tensor_parallel={world} would cut the packed weights' {block}-element quant groups of "
                            f"the linear attention's output ({r * hv} columns a key head)")
    shared = int(cfg.extra.get("shared_expert_intermediate_size", 0))
    if shared and shared < world:
        raise ShardingError(f"shared_expert_intermediate_size {shared} is smaller than tensor_parallel={world}")


MTP_TENSORS = ("mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
               "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.input_layernorm.weight")


def mtp_refused(cfg: ModelConfig, tensor_names: frozenset[str] | None) -> str:
    """Why the checkpoint's multi-token-prediction layer cannot draft, or "" (``tensor_names``:
    a safetensors checkpoint's tensors; None: a GGUF file)."""
    layers = int(cfg.extra.get("mtp_layers", 0))
    if tensor_names is None:
        return "needs a safetensors checkpoint (a GGUF file's MTP blocks are not read)"
    if not layers:
        return "needs a checkpoint with MTP layers (its config has no mtp_num_hidden_layers)"
    if layers != 1:
        return f"takes one MTP layer, and this checkpoint has {layers}"
    if cfg.extra.get("mtp_own_embedding"):
        return "does not read an MTP layer with its own embedding (mtp_use_dedicated_embeddings)"
    missing = [n for n in MTP_TENSORS if n not in tensor_names]
    if missing:
        return f"needs the MTP layer's tensors, and the checkpoint lacks {', '.join(missing)}"
    return ""


def build(cfg: ModelConfig, world: int, rank: int, src, *, dtype, device, max_len: int, block: int = 1,
          mtp: bool = False):
    from ..hybrid import HybridLM
    from ..sharding import plan_shard

    check_split(cfg, world, block)
    return HybridLM(cfg, plan_shard(cfg, world, rank, block), src, dtype=dtype, device=device, max_len=max_len,
                    block=block, mtp=mtp)
