"""GGUF files of a hybrid-family test checkpoint (Qwen3-Next, Qwen3.5 dense and MoE), written
the way llama.cpp's convert_hf_to_gguf.py writes them (Qwen3NextModel, Qwen3_5TextModel,
Qwen3_5MoeTextModel): its metadata keys, its tensor names, and its transforms (norms as 1 + w,
A_log as -exp(A_log), Qwen3-Next's in_proj_qkvz split in two, Qwen3.5's value heads reordered
from grouped by key head to tiled). neuron.loader.gguf_hybrid reads them back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .families import natural_key, read_json, read_safetensors
from .gguf_writer import finish, open_writer, parse_gguf_types, tensor_type

ARCHS = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5": "qwen35",
         "qwen3_5_moe_text": "qwen35moe", "qwen3_5_moe": "qwen35moe"}
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
         "self_attn.k_norm.weight")
NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def write_hybrid_gguf(out_dir: str | Path, gguf_type: str) -> Path:
    """Convert the hybrid checkpoint in ``out_dir`` to ``out_dir/model-<TYPE>.gguf``."""
    import gguf

    (type_name,) = parse_gguf_types(gguf_type)
    out = Path(out_dir)
    raw = read_json(out / "config.json")
    config = raw.get("text_config", raw)
    arch = ARCHS[raw["model_type"]]
    path = out / f"model-{type_name}.gguf"
    writer = open_writer(path, arch, f"neuron-tiny-{raw['model_type']}", type_name, out, config["vocab_size"],
                         lambda w: _add_hparams(w, arch, config))
    qtype = gguf.GGMLQuantizationType[type_name]
    for name, array in _tensors(arch, config, read_safetensors(out)):
        kind = tensor_type(name, array, qtype)
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    return finish(writer, path)


def _add_hparams(writer: Any, arch: str, c: dict[str, Any]) -> None:
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rope = c.get("rope_parameters") or {}
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c.get("intermediate_size") or 0)
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if c.get("num_experts"):
        writer.add_expert_count(c["num_experts"])
        writer.add_expert_used_count(c["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(c.get("shared_expert_intermediate_size", 0))
    writer.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(c["linear_key_head_dim"])
    writer.add_ssm_group_count(c["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(c["linear_num_value_heads"])
    writer.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    writer.add_full_attention_interval(c.get("full_attention_interval", 4))
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))))
    if arch != "qwen3next":
        writer.add_rope_dimension_sections(rope.get("mrope_section", [11, 11, 10]) + [0])


def _tiled(x: np.ndarray, dim: int, nk: int, r: int, width: int) -> np.ndarray:
    """Value heads along ``dim`` from grouped by key head to tiled (llama.cpp's _reorder_v_heads)."""
    shape = list(x.shape)
    y = x.reshape(*shape[:dim], nk, r, width, *shape[dim + 1:])
    return np.ascontiguousarray(np.swapaxes(y, dim, dim + 1)).reshape(shape)


def _tensors(arch: str, c: dict[str, Any], tensors: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    hk, hv, r = c["linear_key_head_dim"], c["linear_value_head_dim"], nv // nk
    out: list[tuple[str, np.ndarray]] = []
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name in sorted(tensors, key=natural_key):
        x = np.asarray(tensors[name], dtype=np.float32)
        name = name.replace("model.language_model.", "model.")
        if name.startswith(("model.visual.", "mtp.")):
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            gname = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                     "model.norm.weight": "output_norm.weight"}[name]
            out.append((gname, x + 1 if name == "model.norm.weight" else x))
            continue
        _, _, block, rest = name.split(".", 3)
        b = int(block)
        if rest.startswith("mlp.experts."):
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault((b, proj), {})[int(e)] = x
            continue
        if rest in NORMS:
            x = x + 1
        elif rest == "linear_attn.A_log":
            x = -np.exp(x)
        elif rest == "linear_attn.conv1d.weight":
            x = x.reshape(x.shape[0], x.shape[-1])
        if arch != "qwen3next" and r > 1 and rest.startswith("linear_attn."):
            qk = 2 * nk * hk
            if rest in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
                x = np.concatenate([x[:qk], _tiled(x[qk:], 0, nk, r, hv)])
            elif rest == "linear_attn.in_proj_z.weight":
                x = _tiled(x, 0, nk, r, hv)
            elif rest in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.A_log",
                          "linear_attn.dt_bias"):
                x = _tiled(x, 0, nk, r, 1)
            elif rest == "linear_attn.out_proj.weight":
                x = _tiled(x, 1, nk, r, hv)
        if rest == "linear_attn.in_proj_qkvz.weight":  # per key head [q k v z] -> [q..., k..., v...] and [z...]
            parts = x.reshape(nk, 2 * hk + 2 * r * hv, -1)
            q, k, v, z = np.split(parts, [hk, 2 * hk, 2 * hk + r * hv], axis=1)
            out.append((f"blk.{b}.attn_qkv.weight", np.concatenate([a.reshape(-1, x.shape[1]) for a in (q, k, v)])))
            out.append((f"blk.{b}.attn_gate.weight", z.reshape(-1, x.shape[1])))
            continue
        out.append((f"blk.{b}.{NAMES[rest]}", np.ascontiguousarray(x)))
    for (b, proj), by_expert in sorted(experts.items()):
        out.append((f"blk.{b}.ffn_{proj.removesuffix('_proj')}_exps.weight",
                    np.stack([by_expert[e] for e in sorted(by_expert)])))
    return out
