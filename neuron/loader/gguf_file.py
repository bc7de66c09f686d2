"""A fast reader of a GGUF file's layout: metadata as plain Python values and each tensor as a
memory-mapped numpy array (the same arrays ``gguf.GGUFReader`` gives: elements for F32/F16/
integer types, bytes with the last dimension in bytes for BF16 and the quantised types).

``gguf.GGUFReader`` builds numpy views for every part of every metadata value; a tokenizer of
50k-150k strings costs it seconds, here tens of milliseconds. Only little-endian GGUF v2/v3.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
MAX_ARRAY_DEPTH = 4  # llama.cpp reads no nested arrays at all
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")
_ELEMENT_TYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


# Hugging Face tensor names -> GGUF names (llama.cpp's convert_hf_to_gguf.py).
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "rope_freqs": "rope_freqs.weight",  # llama3 rope scaling, stored as per-frequency divisors
}


# The hybrid family's architectures (llama.cpp's Qwen3NextModel and Qwen3_5*TextModel): the
# tensors its converter renames; neuron.loader.gguf_hybrid undoes what it transforms.
HYBRID_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
HYBRID_LAYER_TENSORS = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",  # qwen3next: rows of ssm_ba
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",  # qwen3next: rows of ssm_ba
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def gguf_name(hf_name: str, arch: str = "") -> str:
    if hf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        if arch in HYBRID_ARCHS and parts[3] in HYBRID_LAYER_TENSORS:
            name = HYBRID_LAYER_TENSORS[parts[3]]
            if arch == "qwen3next" and name in ("ssm_beta.weight", "ssm_alpha.weight"):
                name = "ssm_ba.weight"
            return f"blk.{parts[2]}.{name}"
        if parts[3] in LAYER_TENSORS:
            return f"blk.{parts[2]}.{LAYER_TENSORS[parts[3]]}"
    raise KeyError(f"no GGUF name for {hf_name!r}")


def missing_gguf_tensors(required: list[str], present: set[str] | dict[str, Any], arch: str = "") -> list[str]:
    """Which of the Hugging Face names ``required`` (``experts.*`` for a layer's experts) have no
    tensor in a GGUF holding ``present``; named the GGUF way."""
    missing = []
    for name in required:
        if name.endswith(".experts.*"):
            block = f"blk.{name.split('.')[2]}"
            if f"{block}.ffn_gate_up_exps.weight" in present and f"{block}.ffn_down_exps.weight" in present:
                continue
            missing += [g for g in (f"{block}.ffn_{x}_exps.weight" for x in ("gate", "up", "down")) if g not in present]
        elif gguf_name(name, arch) not in present:
            missing.append(gguf_name(name, arch))
    return missing


class GgufFormatError(ValueError):
    """Not a GGUF file we can read."""


@dataclass(frozen=True)
class GgufTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: rows first (GGUF stores the dims reversed)
    data: np.ndarray  # memory-mapped; for quantised types and BF16 the last dim is in bytes


class GgufFile:
    def __init__(self, path: str | Path, *, read_tensors: bool = True) -> None:
        self.path = Path(path)
        try:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise GgufFormatError(f"{self.path.name} cannot be mapped: {exc}") from None
        self._buf = memoryview(self._mm)
        self._pos = 0
        try:
            self._parse(read_tensors)
        except (struct.error, IndexError, UnicodeDecodeError, KeyError, ValueError, TypeError, OverflowError) as exc:
            if isinstance(exc, GgufFormatError):
                raise
            raise GgufFormatError(f"{self.path.name} is not a readable GGUF file: {exc}") from None

    # ------------------------------------------------------------------------------ parsing
    def _take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._take("<Q")
        end = self._pos + n
        if end > len(self._buf):
            raise GgufFormatError(f"{self.path.name}: a string runs past the end of the file")
        text = bytes(self._buf[self._pos:end]).decode("utf-8", errors="replace")
        self._pos = end
        return text

    def _strings(self, count: int) -> list[str]:
        """An array of strings (a tokenizer's 50-150k tokens and merges) in one tight loop."""
        buf, pos, size, length = self._buf, self._pos, len(self._buf), _LENGTH.unpack_from
        out = []
        for _ in range(count):
            n = length(buf, pos)[0]
            pos += 8
            if pos + n > size:
                raise GgufFormatError(f"{self.path.name}: a string runs past the end of the file")
            out.append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self._pos = pos
        return out

    def _value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALAR:
            return self._take(_SCALAR[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GgufFormatError(f"{self.path.name}: metadata arrays nested over {MAX_ARRAY_DEPTH} deep")
            etype, count = self._take("<I"), self._take("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                end = self._pos + count * dt.itemsize
                if end > len(self._buf):
                    raise GgufFormatError(f"{self.path.name}: an array runs past the end of the file")
                values = np.frombuffer(self._buf[self._pos:end], dtype=dt).tolist()
                self._pos = end
                return values
            if count > len(self._buf) - self._pos:  # every element takes a byte at least
                raise GgufFormatError(f"{self.path.name}: an array of {count} runs past the end of the file")
            if etype == _STRING:
                return self._strings(count)
            return [self._value(etype, depth + 1) for _ in range(count)]
        raise GgufFormatError(f"{self.path.name}: unknown metadata value type {vtype}")

    def _parse(self, read_tensors: bool) -> None:
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise GgufFormatError(f"{self.path.name} is not a GGUF file (no GGUF magic)")
        self._pos = 4
        self.version = self._take("<I")
        if self.version not in (2, 3):
            raise GgufFormatError(f"{self.path.name}: GGUF version {self.version} is not supported (2 or 3; "
                                  f"big-endian files are not supported)")
        n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._take("<I")
            if n_dims > 4:  # GGML_MAX_DIMS
                raise GgufFormatError(f"{self.path.name}: tensor {name[:100]!r} has {n_dims} dimensions")
            dims = [self._take("<Q") for _ in range(n_dims)]
            qtype = GGMLQuantizationType(self._take("<I"))
            infos.append((name, tuple(reversed(dims)), qtype, self._take("<Q")))
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GgufFormatError(f"{self.path.name}: alignment {alignment} is not a power of two")
        self.data_offset = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GgufTensor] = {}
        for name, shape, qtype, offset in infos:
            data = self._tensor_array(shape, qtype, self.data_offset + offset) if read_tensors else np.empty(0)
            self.tensors[name] = GgufTensor(name, qtype, shape, data)

    def _tensor_array(self, shape: tuple[int, ...], qtype: GGMLQuantizationType, start: int) -> np.ndarray:
        block, size = GGML_QUANT_SIZES[qtype]
        if shape and shape[-1] % block:
            raise GgufFormatError(f"{self.path.name}: a row of {shape[-1]} is not whole {qtype.name} blocks")
        if qtype in _ELEMENT_TYPES:
            dt, byte_shape = np.dtype(_ELEMENT_TYPES[qtype]), shape
        else:
            dt, byte_shape = np.dtype(np.uint8), (*shape[:-1], shape[-1] // block * size)
        count = math.prod(byte_shape)
        end = start + count * dt.itemsize
        if end > len(self._mm):
            raise GgufFormatError(f"{self.path.name} is truncated: a tensor ends at byte {end}, "
                                  f"the file has {len(self._mm)}")
        return self._mm[start:end].view(dt).reshape(byte_shape)
