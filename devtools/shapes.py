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
    write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": index})
    write_json(out / "config.json", config)
    write_tokenizer(out, tokenizer, config)
    write_json(out / "generation_config.json", generation_config(config))
    return out
