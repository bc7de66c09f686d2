"""Checkpoints their publisher quantized (``quantization_config`` in ``config.json``, or weights
stored in a float8 or packed integer dtype): the methods neuron reads (AWQ and GPTQ, 4 and 8 bits)
are described for the ranks (``CheckpointQuant``; ``published`` reads them), everything else is
refused at load by name: a quantized weight read as if it were float answers with wrong tokens
and no error."""

from __future__ import annotations

from typing import Any

from protocol import CheckpointQuant

from neuron.errors import UnsupportedModel

# What a user can load instead, named in every refusal.
INSTEAD = ("FP8 (block, per-row or per-tensor scales; fp8 and compressed-tensors), AWQ (GEMM, 4 bits) and GPTQ "
           "(4 and 8 bits) checkpoints, float checkpoints (bf16, f16, f32; quantize = "
           "\"q8_0\" or \"q4\" packs them at load) and GGUF files (Q4_0, Q4_1, Q4_K, Q5_x, Q6_K, Q8_0, ...)")


def checkpoint_quant(raw: dict[str, Any], dtypes: dict[str, int]) -> CheckpointQuant | None:
    """How the checkpoint of config.json ``raw`` is quantized (None: it is not), or
    UnsupportedModel naming what neuron cannot read."""
    for where, config in (("config.json", raw), ("config.json's text_config", raw.get("text_config"))):
        if isinstance(config, dict) and isinstance(config.get("quantization_config"), dict):
            q = config["quantization_config"]
            read = _readable(q, where)
            if read is not None:
                return read
            break
    refuse_prequantized(raw, dtypes)
    return None


def _readable(q: dict[str, Any], where: str) -> CheckpointQuant | None:
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8(q, where)
    if method == "compressed-tensors":
        return _compressed_tensors(q, where)
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size", 128))
    if method not in ("awq", "gptq") or not isinstance(bits, int) or not isinstance(group, int):
        return None
    what = f"{where} declares quant_method {method!r} (bits {bits}, group_size {group})"
    if bits not in ((4,) if method == "awq" else (4, 8)):
        raise UnsupportedModel(f"{what}: {bits}-bit {method.upper()} is not supported; supported: {INSTEAD}")
    if group != -1 and (group <= 0 or group % 32):
        raise UnsupportedModel(f"{what}: groups that are not whole multiples of 32 columns (or -1) are not supported; supported: {INSTEAD}")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedModel(f"{what}: AWQ's {version!r} layout is not supported (GEMM is); supported: {INSTEAD}")
        if q.get("zero_point") is False:
            raise UnsupportedModel(f"{what}: AWQ without zero points is not supported; supported: {INSTEAD}")
        keep = q.get("modules_to_not_convert") or []
        return CheckpointQuant("awq", bits, group, False, [], [str(m) for m in keep])
    fmt = str(q.get("checkpoint_format", q.get("format", "gptq"))).lower()
    if fmt not in ("gptq", ""):
        raise UnsupportedModel(f"{what}: GPTQ's {fmt!r} checkpoint format is not supported (the v1 'gptq' one is); "
                               f"supported: {INSTEAD}")
    keep = q.get("modules_to_not_convert") or []
    return CheckpointQuant("gptq", bits, group, bool(q.get("sym", True)), [], [str(m) for m in keep])
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


def _fp8(q: dict[str, Any], where: str) -> CheckpointQuant:
    what = f"{where} declares quant_method 'fp8'{_describe(q)}"
    scheme = str(q.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise UnsupportedModel(f"{what}: activation_scheme {scheme!r} (fixed activation scales) is not supported, "
                               f"'dynamic' is; supported: {INSTEAD}")
    block = q.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedModel(f"{what}: weight_block_size must be two positive integers; supported: {INSTEAD}")
    keep = [str(m) for m in (q.get("modules_to_not_convert") or []) + (q.get("ignored_layers") or [])]
    return CheckpointQuant("fp8", 8, 0, True, list(block or []), keep)


def _compressed_tensors(q: dict[str, Any], where: str) -> CheckpointQuant:
    """compressed-tensors' FP8: every config group's weights 8-bit floats by tensor, channel or
    block, its activations none or dynamic."""
    what = f"{where} declares quant_method 'compressed-tensors' (format {q.get('format')!r})"
    groups = q.get("config_groups") or {}
    blocks = set()
    for name, group in groups.items():
        w, a = (group or {}).get("weights") or {}, (group or {}).get("input_activations")
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise UnsupportedModel(f"{what}: group {name!r} has {w.get('num_bits')}-bit {w.get('type')} weights, "
                                   f"which are not supported (only FP8 ones are); supported: {INSTEAD}")
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise UnsupportedModel(f"{what}: group {name!r} has weights by {strategy!r}, which is not supported; supported: {INSTEAD}")
        if a and not a.get("dynamic", False):
            raise UnsupportedModel(f"{what}: group {name!r} has static activation scales, which are not supported; supported: {INSTEAD}")
        blocks.add(tuple(w.get("block_structure") or ()) if strategy == "block" else ())
    if not groups or len(blocks) > 1:
        raise UnsupportedModel(f"{what}: {'no config_groups' if not groups else 'mixed weight strategies'} (not supported); "
                               f"supported: {INSTEAD}")
    return CheckpointQuant("fp8", 8, 0, True, list(blocks.pop()), [str(m) for m in q.get("ignore") or []])


def _describe(q: dict[str, Any]) -> str:
    """The settings that tell one variant of a method from another, as ``(bits 4, group_size 128)``."""
    keys = ("bits", "w_bit", "group_size", "q_group_size", "weight_block_size", "fmt", "activation_scheme",
            "load_in_4bit", "load_in_8bit", "format")
    shown = [f"{k} {q[k]}" for k in keys if q.get(k) not in (None, False)]
    return f" ({', '.join(shown)})" if shown else ""
