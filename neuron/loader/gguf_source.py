"""Reads tensors from a GGUF file by their Hugging Face names, dequantising only the rows (or
block-aligned columns) a rank asks for. The file is memory-mapped, so untouched parts are never
read."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from .gguf_file import GgufFile, gguf_name

if TYPE_CHECKING:
    from neuron.models.quant import QuantWeight

class GgufSource:
    def __init__(self, path: str, *, num_heads: int, num_kv_heads: int) -> None:
        self.file = GgufFile(path)
        self.tensors = self.file.tensors
        arch = self.arch = str(self.file.fields.get("general.architecture", ""))
        # llama.cpp's converter permutes llama Q/K rows for its RoPE layout; we undo it per head.
        self._permuted = {"attn_q": num_heads, "attn_k": num_kv_heads} if arch == "llama" else {}
        from neuron.models.quant import is_quantized

        self.quantized = any(is_quantized(t.qtype) for t in self.tensors.values())

    def has(self, name: str) -> bool:
        if name.endswith("experts.gate_up_proj"):
            return self.has(name.replace("gate_up_proj", "down_proj"))
        try:
            return gguf_name(name, self.arch) in self.tensors
        except KeyError:
            return False

    def get(self, name: str, *, dim: int | None = None, part: range | None = None) -> torch.Tensor:
        if name.endswith("experts.gate_up_proj"):
            layer = name.split(".")[2]
            if f"blk.{layer}.ffn_gate_up_exps.weight" in self.tensors:  # gate and up stacked already
                return torch.from_numpy(self._read(f"blk.{layer}.ffn_gate_up_exps.weight", dim, part))
            gate = self._read(f"blk.{layer}.ffn_gate_exps.weight", dim, part)
            up = self._read(f"blk.{layer}.ffn_up_exps.weight", dim, part)
            return torch.from_numpy(np.concatenate([gate, up], axis=1))
        gname = gguf_name(name, self.arch)
        data = self._read(gname, dim, part)
        kind = gname.split(".")[-2]
        if kind in self._permuted:
            data = _unpermute(data, self._permuted[kind], self._rows(gname), part if dim in (0, None) else None)
        return torch.from_numpy(data if data.flags.writeable and data.flags.c_contiguous else np.array(data))

    def get_quant(self, name: str, *, dim: int | None = None, part: range | None = None) -> QuantWeight | None:
        """A 2-D quantized tensor's rows (dim 0) or group-aligned columns (dim 1) as packed groups,
        never dequantized; None where the file holds floats."""
        from neuron.models.quant import GROUP, decode_blocks, is_quantized

        expert = _EXPERT.fullmatch(name)
        fused = expert is not None and expert[3] != "down" and f"blk.{expert[1]}.ffn_gate_up_exps.weight" in self.tensors
        if fused:  # gate and up of each expert stacked in one tensor: its half
            gname = f"blk.{expert[1]}.ffn_gate_up_exps.weight"
        elif expert:  # one expert's matrix of a layer's stacked experts
            gname = f"blk.{expert[1]}.ffn_{expert[3]}_exps.weight"
        else:
            gname = gguf_name(name, self.arch)
        t = self.tensors.get(gname)
        if t is None:
            raise KeyError(f"tensor {gname!r} is not in the GGUF file")
        raw = t.data[int(expert[2])] if expert else t.data
        if fused:
            half = raw.shape[0] // 2
            raw = raw[:half] if expert[3] == "gate" else raw[half:]
        if not is_quantized(t.qtype) or raw.ndim != 2:
            return None
        if part is not None and dim == 1:
            block, size = GGML_QUANT_SIZES[t.qtype]
            first, end = part.start // block, -(-part.stop // block)
            skip = part.start - first * block
            if skip % GROUP:
                raise ValueError(f"{gname}: columns from {part.start} do not start on a {GROUP}-element group")
            q = decode_blocks(raw[:, first * size: end * size], t.qtype)
            return q.columns(range(skip, skip + len(part)))
        if part is not None:
            raw = raw[part.start: part.stop]
        q = decode_blocks(raw, t.qtype)
        kind = gname.split(".")[-2]
        if kind in self._permuted:
            order = _unpermute(np.arange(q.shape[0])[:, None], self._permuted[kind], self._rows(gname), part)
            q = q.with_rows(order.ravel())
        return q

    def _rows(self, gname: str) -> int:
        return int(self.tensors[gname].data.shape[0])

    def _read(self, gname: str, dim: int | None, part: range | None) -> np.ndarray:
        t = self.tensors.get(gname)
        if t is None:
            raise KeyError(f"tensor {gname!r} is not in the GGUF file")
        qtype, raw = t.qtype, t.data
        if part is not None and (dim or 0) < raw.ndim - 1:
            index = [slice(None)] * raw.ndim
            index[dim or 0] = slice(part.start, part.stop)
            return self._dequant(raw[tuple(index)], qtype)
        if part is not None:
            return self._dequant_columns(raw, qtype, part)
        return self._dequant(raw, qtype)

    def _dequant_columns(self, raw: np.ndarray, qtype: GGMLQuantizationType, part: range) -> np.ndarray:
        """Columns ``part`` of every row: only the blocks that hold them are dequantised."""
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):  # raw holds elements
            return self._dequant(raw[..., part.start: part.stop], qtype)
        block, size = GGML_QUANT_SIZES[qtype]  # raw holds bytes, ``size`` per ``block`` elements
        first, end = part.start // block, -(-part.stop // block)
        values = self._dequant(raw[..., first * size: end * size], qtype)
        skip = part.start - first * block
        return values[..., skip: skip + len(part)]

    @staticmethod
    def _dequant(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        if qtype == GGMLQuantizationType.F32:
            return np.asarray(raw, dtype=np.float32)
        return dequantize(np.ascontiguousarray(raw), qtype).astype(np.float32, copy=False)


_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def _unpermute(w: np.ndarray, n_head: int, total_rows: int, part: range | None) -> np.ndarray:
    head_dim = total_rows // n_head
    heads = w.shape[0] // head_dim
    if part is not None and part.start % head_dim:
        raise ValueError("a Q/K slice must hold whole heads")
    return w.reshape(heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
