"""Checkpoints their publisher quantized (``quantization_config`` in ``config.json``, or weights
stored in a float8 or packed integer dtype). neuron reads none of these formats yet, so each is
refused at load by name: a quantized weight read as if it were float answers with wrong tokens
and no error."""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModel

# What a user can load instead, named in every refusal.
INSTEAD = ("float checkpoints (bf16, f16, f32; quantize = \"q8_0\" or \"q4\" packs them at load) and GGUF files "
           "(Q4_0, Q4_1, Q4_K, Q5_x, Q6_K, Q8_0, ...)")
# safetensors dtypes that hold quantized values, not weights one can multiply by.
QUANTIZED_DTYPES = ("f8_e4m3", "f8_e5m2", "f8_e8m0", "f4", "f6_e2m3", "f6_e3m2", "i4", "u4")


def refuse_prequantized(raw: dict[str, Any], dtypes: dict[str, int]) -> None:
    """Raise UnsupportedModel for a quantized checkpoint: ``raw`` is its config.json, ``dtypes``
    the number of 2-D tensors of each safetensors dtype (lower case)."""
    for where, config in (("config.json", raw), ("config.json's text_config", raw.get("text_config"))):
        if not isinstance(config, dict) or config.get("quantization_config") is None:
            continue
        q = config["quantization_config"]
        method = q.get("quant_method") if isinstance(q, dict) else None
        detail = _describe(q) if isinstance(q, dict) else ""
        named = f"quant_method {method!r}" if method else "a quantization_config without a quant_method"
        raise UnsupportedModel(f"{where} declares {named}{detail}: checkpoints quantized by their publisher are not "
                               f"supported yet; supported: {INSTEAD}")
    found = sorted(d for d in dtypes if d in QUANTIZED_DTYPES)
    if found:
        raise UnsupportedModel(f"the weights are stored as {', '.join(found)} without a quantization_config that says "
                               f"how to read them; supported: {INSTEAD}")
    packed = sorted(d for d in dtypes if d in ("i32", "u32", "i8", "u8"))
    if packed:
        raise UnsupportedModel(f"the weights hold {', '.join(packed)} matrices (packed integers, as AWQ or GPTQ "
                               f"write them) and no quantization_config; supported: {INSTEAD}")


def _describe(q: dict[str, Any]) -> str:
    """The settings that tell one variant of a method from another, as ``(bits 4, group_size 128)``."""
    keys = ("bits", "w_bit", "group_size", "q_group_size", "weight_block_size", "fmt", "activation_scheme",
            "load_in_4bit", "load_in_8bit", "format")
    shown = [f"{k} {q[k]}" for k in keys if q.get(k) not in (None, False)]
    return f" ({', '.join(shown)})" if shown else ""
