"""The hybrid family's GGUF files (llama.cpp's ``qwen3next``, ``qwen35``, ``qwen35moe``) read
back as the checkpoint they were converted from. llama.cpp's converter (``Qwen3NextModel`` and
its Qwen3.5 subclasses in convert_hf_to_gguf.py):

- stores the zero-centred RMS norms (every one but the gated norm of linear attention) as
  ``1 + w``, and ``A_log`` as ``-exp(A_log)``;
- splits Qwen3-Next's ``in_proj_qkvz`` into ``attn_qkv`` (all q heads, all k heads, all v heads)
  and ``attn_gate`` (z), keeps ``in_proj_ba`` as ``ssm_ba``;
- for Qwen3.5, where a key head serves ``r > 1`` value heads, reorders the value heads from
  grouped by key head (``k0: v0..v{r-1}, k1: ...``, as transformers keeps them) to tiled
  (``v0 of every key head, then v1 of every key head, ...``): the v rows of ``attn_qkv`` and of
  the conv, ``attn_gate``'s rows, ``ssm_beta``/``ssm_alpha``, ``ssm_a``, ``ssm_dt`` and the
  columns of ``ssm_out``.

Each is undone here, so the model reads the same values it reads from the safetensors; a
reordered matrix is read whole, reordered (packed, where it is quantized), then cut to the
rank's share.
"""

from __future__ import annotations

import numpy as np
import torch

from neuron.models.quant import GROUP, QuantWeight, decode_blocks, is_quantized

from .gguf_file import gguf_name
from .gguf_source import GgufSource

ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                "self_attn.k_norm.weight")


class HybridGgufSource(GgufSource):
    def __init__(self, path: str, config) -> None:
        super().__init__(path, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
        x = config.extra
        self.nk, self.nv = int(x["linear_num_key_heads"]), int(x["linear_num_value_heads"])
        self.hk, self.hv = int(x["linear_key_head_dim"]), int(x["linear_value_head_dim"])
        self.r = self.nv // self.nk
        self.tiled = self.arch != "qwen3next" and self.r > 1

    def get(self, name: str, *, dim: int | None = None, part: range | None = None) -> torch.Tensor:
        rows, columns = self._order(name)
        if rows is None and columns is None:
            value = super().get(name, dim=dim, part=part)
        else:
            whole = self._read(gguf_name(name, self.arch), None, None)
            whole = whole[rows] if rows is not None else whole[:, columns]
            value = torch.from_numpy(np.ascontiguousarray(_cut(whole, dim, part)))
        if name == "model.norm.weight" or name.endswith(ZERO_CENTRED):
            value = value - 1.0
        elif name.endswith("linear_attn.A_log"):
            value = torch.log(-value)
        return value

    def get_quant(self, name: str, *, dim: int | None = None, part: range | None = None) -> QuantWeight | None:
        rows, columns = self._order(name)
        if rows is None and columns is None:
            return super().get_quant(name, dim=dim, part=part)
        t = self.tensors[gguf_name(name, self.arch)]
        if not is_quantized(t.qtype) or t.data.ndim != 2 or (columns is not None and self.hv % GROUP):
            return None  # (value heads narrower than a quant group cannot move in packed form: read dense)
        q = decode_blocks(t.data, t.qtype)
        q = q.with_rows(rows) if rows is not None else q.with_column_order(columns)
        if part is None:
            return q
        return q.columns(part) if dim == 1 else q.rows(part)

    def _order(self, name: str) -> tuple[np.ndarray | None, np.ndarray | None]:
        """For a tensor the converter reordered: which of the file's rows (or columns) each of the
        checkpoint's is."""
        if ".linear_attn." not in name:
            return None, None
        part = name.rsplit(".linear_attn.", 1)[1]
        if self.arch == "qwen3next" and part in ("in_proj_b.weight", "in_proj_a.weight"):
            r = self.r  # ssm_ba: per key head, its r rows of b then its r rows of a
            first = 0 if part == "in_proj_b.weight" else r
            return np.array([g * 2 * r + first + j for g in range(self.nk) for j in range(r)]), None
        if not self.tiled:
            return None, None
        qk = 2 * self.nk * self.hk
        if part in ("in_proj_qkv.weight", "conv1d.weight"):
            return np.concatenate([np.arange(qk), qk + self._tiled(self.hv)]), None
        if part == "in_proj_z.weight":
            return self._tiled(self.hv), None
        if part in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
            return self._tiled(1), None
        if part == "out_proj.weight":
            return None, self._tiled(self.hv)
        return None, None

    def _tiled(self, width: int) -> np.ndarray:
        """For each row of the value heads in grouped order (``width`` rows a head), its row in
        the tiled order: value head ``m`` of key head ``g`` is head ``m * nk + g`` there."""
        heads = np.array([m * self.nk + g for g in range(self.nk) for m in range(self.r)])
        return (heads[:, None] * width + np.arange(width)[None, :]).ravel()


def _cut(whole: np.ndarray, dim: int | None, part: range | None) -> np.ndarray:
    if part is None:
        return whole
    index = [slice(None)] * whole.ndim
    index[dim or 0] = slice(part.start, part.stop)
    return whole[tuple(index)]
