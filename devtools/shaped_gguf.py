"""A random-weight GGUF of a real model's shape, for measuring CPU decode against llama.cpp on a
model of the size CPU users run (issue 73): every projection and the embedding hold random valid
blocks of the requested type (scales drawn so the weights stay around +-0.02), norms are ones.
The tokenizer is the test fixture's, its vocabulary padded to the shape's as llama.cpp's converter
pads one, so the embedding and the tied LM head have the real model's size; the padding tokens
are text (``[PAD123]``), which both servers stream, as a random model draws them nearly always.

    python -m devtools.shaped_gguf qwen3-1.7b Q4_0 /tmp/shaped   # -> /tmp/shaped/model-Q4_0.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from .families import family_spec, write_json
from .fixture_tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, build_tokenizer, write_tokenizer
from .gguf_writer import add_hparams, finish, open_writer, random_quant_blocks

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-1.7B's config.json
    "qwen3-1.7b": {"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 40960, "hidden_act": "silu", "torch_dtype": "bfloat16"},
    # the same layout, small: for the tests
    "qwen3-tiny": {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
                   "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 4096, "hidden_act": "silu", "torch_dtype": "bfloat16"},
}
TYPES = ("Q4_0", "Q4_K", "Q8_0")


def layer_tensors(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(gguf name, shape as numpy holds it: [out, in]) of a Qwen3 decoder, as llama.cpp names them."""
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    out = [("token_embd.weight", (config["vocab_size"], h)), ("output_norm.weight", (h,))]
    for i in range(config["num_hidden_layers"]):
        out += [(f"blk.{i}.{name}", shape) for name, shape in (
            ("attn_norm.weight", (h,)), ("attn_q.weight", (q, h)), ("attn_k.weight", (kv, h)),
            ("attn_v.weight", (kv, h)), ("attn_output.weight", (h, q)), ("attn_q_norm.weight", (hd,)),
            ("attn_k_norm.weight", (hd,)), ("ffn_norm.weight", (h,)), ("ffn_gate.weight", (inter, h)),
            ("ffn_up.weight", (inter, h)), ("ffn_down.weight", (h, inter)))]
    return out


def write_shaped_gguf(shape: str, type_name: str, out_dir: str | Path, seed: int = 0) -> Path:
    import gguf

    if type_name not in TYPES:
        raise ValueError(f"{type_name!r} is not one of {TYPES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)}
    config = dict(SHAPES[shape], bos_token_id=ids[BOS_TOKEN], eos_token_id=ids[EOS_TOKEN],
                  pad_token_id=ids[PAD_TOKEN])
    write_json(out / "config.json", config)
    write_tokenizer(out, tokenizer, config)
    spec = family_spec(config["model_type"])
    path = out / f"model-{type_name}.gguf"
    writer = open_writer(path, spec.gguf_arch, f"neuron-random-{shape}", type_name, out, config["vocab_size"],
                         lambda w: add_hparams(w, spec, config), pads_are_text=True)
    rng = np.random.default_rng(seed)
    for name, dims in layer_tensors(config):
        if len(dims) == 1:
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
        else:
            writer.add_tensor(name, random_quant_blocks(type_name, dims, rng),
                              raw_dtype=gguf.GGMLQuantizationType[type_name])
    return finish(writer, path)


if __name__ == "__main__":
    print(write_shaped_gguf(sys.argv[1], sys.argv[2], sys.argv[3]))
