"""Random-weight checkpoints of real model shapes, for speed measurements."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checkpoints import generation_config, tiny_config
from .families import write_json
from .fixture_tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, build_tokenizer, write_tokenizer

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
    # The hybrid family as the published Qwen3.5 configs give it (text model): every fourth layer
    # full attention, the rest Gated DeltaNet.
    "qwen3.5-27b": {"model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
                    "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 248320,
                    "tie_word_embeddings": False},
    "qwen3.5-35b-a3b": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
                        "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                        "shared_expert_intermediate_size": 512, "vocab_size": 248320, "tie_word_embeddings": False},
    "qwen3.5-tiny": {"model_type": "qwen3_5_text", "hidden_size": 128, "intermediate_size": 256,
                     "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                     "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": 512,
                     "tie_word_embeddings": False},  # for trying the scripts on a CPU
}
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text")


def make_shaped_checkpoint(shape: str, out_dir: str | Path, *, device: str = "cpu", dtype: str = "bfloat16",
                           seed: int = 0, layers: int = 0) -> Path:
    """Write a random-weight safetensors checkpoint of a real model shape (one file per layer),
    tensor by tensor on `device`, without building the model; ``layers``: only that many of its
    layers (a slice of the model's widths, quick to write and load). The tokenizer is the tiny test
    one: most generated ids have no text, so measure with ``return_token_ids``."""
    import torch
    from safetensors.torch import save_file

    shaped = dict(SHAPES[shape]) | ({"num_hidden_layers": layers} if layers else {})
    model_type = shaped.pop("model_type")
    if model_type in HYBRID:
        return _hybrid_checkpoint(model_type, shaped, Path(out_dir), device, dtype, seed)
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
    write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": index})
    write_json(out / "config.json", config)
    write_tokenizer(out, tokenizer, config)
    write_json(out / "generation_config.json", generation_config(config))
    return out


def _hybrid_checkpoint(model_type: str, shaped: dict[str, Any], out: Path, device: str, dtype: str, seed: int) -> Path:
    """A Qwen3.5 text checkpoint (dense or MoE) of ``shaped``'s sizes, as transformers saves it."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    layers = shaped["num_hidden_layers"]
    config = shaped | {
        "model_type": model_type, "architectures": ["Qwen3_5ForCausalLM" if model_type == "qwen3_5_text"
                                                    else "Qwen3_5MoeForCausalLM"],
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 16384, "torch_dtype": dtype,
        "bos_token_id": ids[BOS_TOKEN], "eos_token_id": ids[EOS_TOKEN], "pad_token_id": ids[PAD_TOKEN],
        "mtp_num_hidden_layers": 1}
    h, hd, vocab = config["hidden_size"], config["head_dim"], config["vocab_size"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    hk, hv, kernel = config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"]
    gen = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = getattr(torch, dtype)

    def rand(*shape_: int, scale: float = 0.02) -> Any:
        return (torch.randn(*shape_, generator=gen, device=device, dtype=torch.float32) * scale).to(torch_dtype).cpu()

    def zeros(n: int) -> Any:  # a zero-centred norm weight: 1 in use
        return torch.zeros(n, dtype=torch_dtype)

    def mlp(p: str, inter: int) -> dict[str, Any]:
        return {p + "gate_proj.weight": rand(inter, h), p + "up_proj.weight": rand(inter, h),
                p + "down_proj.weight": rand(h, inter)}

    index: dict[str, str] = {}

    def save(name: str, tensors: dict[str, Any]) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    save("model-embed.safetensors", {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": zeros(h),
                                     "lm_head.weight": rand(vocab, h)})
    def layer(p: str, kind: str) -> dict[str, Any]:
        t = {p + "input_layernorm.weight": zeros(h), p + "post_attention_layernorm.weight": zeros(h)}
        if kind == "full_attention":
            a = p + "self_attn."
            t |= {a + "q_proj.weight": rand(2 * nq * hd, h), a + "k_proj.weight": rand(nkv * hd, h),
                  a + "v_proj.weight": rand(nkv * hd, h), a + "o_proj.weight": rand(h, nq * hd),
                  a + "q_norm.weight": zeros(hd), a + "k_norm.weight": zeros(hd)}
        else:
            a = p + "linear_attn."
            conv = 2 * nk * hk + nv * hv
            t |= {a + "in_proj_qkv.weight": rand(conv, h), a + "in_proj_z.weight": rand(nv * hv, h),
                  a + "in_proj_b.weight": rand(nv, h), a + "in_proj_a.weight": rand(nv, h),
                  a + "conv1d.weight": rand(conv, 1, kernel, scale=0.3), a + "A_log": rand(nv, scale=0.5),
                  a + "dt_bias": rand(nv, scale=0.5), a + "norm.weight": torch.ones(hv, dtype=torch_dtype),
                  a + "out_proj.weight": rand(h, nv * hv)}
        if model_type == "qwen3_5_text":
            t |= mlp(p + "mlp.", config["intermediate_size"])
        else:
            experts, inter = config["num_experts"], config["moe_intermediate_size"]
            t |= {p + "mlp.gate.weight": rand(experts, h), p + "mlp.experts.gate_up_proj": rand(experts, 2 * inter, h),
                  p + "mlp.experts.down_proj": rand(experts, h, inter), p + "mlp.shared_expert_gate.weight": rand(1, h)}
            t |= mlp(p + "mlp.shared_expert.", config["shared_expert_intermediate_size"])
        return t

    for i, kind in enumerate(config["layer_types"]):
        save(f"model-layer{i:03d}.safetensors", layer(f"model.layers.{i}.", kind))
    # the multi-token-prediction layer the hub's checkpoints ship (speculative decoding's ``mtp``)
    save("model-mtp.safetensors", layer("mtp.layers.0.", "full_attention") | {
        "mtp.fc.weight": rand(h, 2 * h), "mtp.norm.weight": zeros(h), "mtp.pre_fc_norm_embedding.weight": zeros(h),
        "mtp.pre_fc_norm_hidden.weight": zeros(h)})
    write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": index})
    write_json(out / "config.json", config)
    write_tokenizer(out, tokenizer, config)
    write_json(out / "generation_config.json", generation_config(config))
    return out


def fp8_block_checkpoint(src: str | Path, out_dir: str | Path, *, block: int = 128, device: str = "cpu") -> Path:
    """``src``'s checkpoint as the FP8 releases publish one (Qwen/Qwen3-8B-FP8): each projection
    (``*_proj.weight``) e4m3 with a float32 ``weight_scale_inv`` per ``block`` x ``block`` block
    (its max|w| / 448), everything else (embeddings, LM head, norms) as it was; the config names
    ``quant_method: "fp8"`` with dynamic activations."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for f in sorted(src.glob("*.safetensors")):
        tensors = {}
        for name, w in load_file(f, device=device).items():
            if not name.endswith("_proj.weight") or w.ndim != 2:
                tensors[name] = w
                continue
            N, K = w.shape
            padded = torch.zeros(-(-N // block) * block, -(-K // block) * block, device=w.device)
            padded[:N, :K] = w.float()
            blocks = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [N/b, b, K/b, b]
            scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448
            values = (blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:N, :K]
            tensors[name] = values.to(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = scale
            index["weight_map"][name + "_scale_inv"] = f.name
        save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(out / f.name), metadata={"format": "pt"})
    write_json(out / "model.safetensors.index.json", index)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [block, block]}
    write_json(out / "config.json", config)
    return out


def pack_words(values: Any, bits: int, dim: int, order: tuple[int, ...] | None = None) -> Any:
    """int32 words of ``values`` packed along ``dim``: ``32 / bits`` values a word, value i of a
    word at bits ``bits * i`` (in ``order``: value ``order[i]`` there, AutoAWQ's)."""
    import torch

    per = 32 // bits
    v = values.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per).to(torch.int64)
    if order is not None:
        v = v[..., list(order)]
    word = (v << (bits * torch.arange(per, device=v.device))).sum(-1)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def int4_checkpoint(src: str | Path, out_dir: str | Path, method: str, *, group: int = 128,
                    device: str = "cpu") -> Path:
    """``src``'s checkpoint as the 4-bit releases publish one: ``awq`` (Qwen/Qwen3-8B-AWQ: GEMM
    layout, zero points, ``group`` columns a group) or ``gptq`` (the GPTQ-Int4 releases: symmetric,
    no act order), each projection packed with float16 scales; everything else as it was."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    if method not in ("awq", "gptq"):
        raise ValueError(f"method must be awq or gptq, not {method!r}")
    src, out = Path(src), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file() and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors = {}
        for name, w in load_file(f, device=device).items():
            base = name.removesuffix(".weight")
            if not name.endswith("_proj.weight") or w.ndim != 2:
                tensors[name] = w
                continue
            N, K = w.shape
            x = w.float().reshape(N, K // group, group)
            if method == "awq":
                lo, hi = x.amin(2), x.amax(2)
                s = ((hi - lo) / 15).clamp_min(1e-8).half().float()
                z = torch.round(-lo / s).clamp(0, 15)
            else:
                s = (x.abs().amax(2) / 7).clamp_min(1e-8).half().float()
                z = torch.full_like(s, 8)
            q = torch.clamp(torch.round(x / s[..., None]) + z[..., None], 0, 15).reshape(N, K)
            q, z = q.T.to(torch.int32), z.T.to(torch.int32)  # [K, N], [G, N]
            tensors[base + ".scales"] = s.T.half().contiguous()
            if method == "awq":
                tensors[base + ".qweight"] = pack_words(q, 4, 1, AWQ_ORDER)
                tensors[base + ".qzeros"] = pack_words(z, 4, 1, AWQ_ORDER)
            else:
                tensors[base + ".qweight"] = pack_words(q, 4, 0)
                tensors[base + ".qzeros"] = pack_words(z - 1, 4, 1)
                tensors[base + ".g_idx"] = torch.arange(K, dtype=torch.int32, device=q.device) // group
        save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(out / f.name), metadata={"format": "pt"})
        weight_map |= {k: f.name for k in tensors}
    write_json(out / "model.safetensors.index.json", {"metadata": index.get("metadata", {}), "weight_map": weight_map})
    config = json.loads((src / "config.json").read_text())
    quant = {"quant_method": method, "bits": 4, "group_size": group}
    quant |= {"version": "gemm", "zero_point": True} if method == "awq" else {"sym": True, "desc_act": False}
    write_json(out / "config.json", config | {"quantization_config": quant})
    return out
