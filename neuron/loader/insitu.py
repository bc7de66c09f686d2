"""In-situ quantization: a float checkpoint (bf16/fp16/fp32 safetensors, or a float GGUF) read
through a source that quantizes each projection weight as a rank reads its slice, so a rank
only ever quantizes (and holds) its own share. Weights a GGUF file already holds quantized keep
the file's own blocks: they are never requantized."""

from __future__ import annotations

import re

import torch

from neuron.models.fp8 import Fp8Weight, quantize_fp8
from neuron.models.quant import GROUP, SCHEMES, QuantWeight, quantize


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def fp8_columns(k: int) -> int:
    """In-situ FP8's column group for a matrix of ``k`` columns: the widest that the FP8 tensor
    cores take (128, 64) and that divides ``k``, else 32 (then its products unpack the weight)."""
    return next((c for c in (128, 64) if k % c == 0), 32)


def quantizable(name: str) -> bool:
    """Projection and vocabulary matrices; norms and the MoE router stay as they are."""
    return name.endswith(".weight") and not name.endswith("norm.weight") and not name.endswith("mlp.gate.weight")


class QuantizingSource:
    """``device``: where the weights are quantized (the rank's GPU; None: the CPU)."""

    def __init__(self, src, scheme: str, device: torch.device | None = None) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown quantization {scheme!r} (known: {', '.join(SCHEMES)})")
        self.src, self.scheme, self.device = src, scheme, device
        self.quantized = True

    def has(self, name: str) -> bool:
        return self.src.has(name)

    def get_quant(self, name: str, *, dim: int | None = None, part: range | None = None) -> QuantWeight | None:
        own = getattr(self.src, "get_quant", None)
        if own is not None and (q := own(name, dim=dim, part=part)) is not None:
            return q
        w = self._float(name, dim, part) if self.scheme != "fp8" else None
        return quantize(w, self.scheme, self.device) if w is not None else None

    def get_fp8(self, name: str, *, dim: int | None = None, part: range | None = None) -> Fp8Weight | None:
        own = getattr(self.src, "get_fp8", None)
        if own is not None and (f := own(name, dim=dim, part=part)) is not None:
            return f
        if self.scheme != "fp8":
            return None
        packed = getattr(self.src, "get_quant", None)
        if packed is not None and packed(name, dim=dim, part=part) is not None:
            return None  # a weight the file holds packed stays as it is
        if dim != 1 or part is None or not self.src.has(name):
            w = self._float(name, dim, part)
            return quantize_fp8(w, fp8_columns(w.shape[1]), self.device) if w is not None else None
        # A share of the columns: the groups it cuts are quantized whole, so that every rank holds
        # the whole matrix's values and scales whatever the split.
        k = self.src.shape(name)[1] if hasattr(self.src, "shape") else self.src.get(name).shape[1]
        c = fp8_columns(k)
        lo, hi = part.start - part.start % c, min(k, -(-part.stop // c) * c)
        w = self._float(name, 1, range(lo, hi))
        if w is None:
            return None
        q, keep = quantize_fp8(w, c, self.device), slice(part.start - lo, part.stop - lo)
        return Fp8Weight(q.values[:, keep].contiguous(), q.scale, q.col_block[keep], q.source)

    def _float(self, name: str, dim: int | None, part: range | None) -> torch.Tensor | None:
        """A projection's float share, to quantize (None: not one)."""
        if not quantizable(name):
            return None
        w = self._expert(name) if _EXPERT.fullmatch(name) and not self.src.has(name) else self.src.get(
            name, dim=dim, part=part)
        return w if w.ndim == 2 and not w.shape[1] % GROUP else None

    def _expert(self, name: str) -> torch.Tensor:
        """One expert's matrix out of a checkpoint that stacks them (``experts.gate_up_proj``)."""
        prefix, e, proj = _EXPERT.fullmatch(name).groups()  # type: ignore[union-attr]
        if proj == "down":
            return self.src.get(f"{prefix}.down_proj", dim=0, part=range(int(e), int(e) + 1))[0]
        gate_up = self.src.get(f"{prefix}.gate_up_proj", dim=0, part=range(int(e), int(e) + 1))[0]
        half = gate_up.shape[0] // 2
        return gate_up[:half] if proj == "gate" else gate_up[half:]

    def get(self, name: str, *, dim: int | None = None, part: range | None = None) -> torch.Tensor:
        """Floats; a quantizable weight comes back quantized and dequantized (the float32
        reference of the packed model)."""
        if getattr(self.src, "quantized", False):  # a quantized GGUF: its floats are norms and the like
            return self.src.get(name, dim=dim, part=part)
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # stacked experts [E, rows, K]
            w = self.src.get(name, dim=dim, part=part)
            if w.shape[-1] % GROUP:
                return w
            flat = w.reshape(-1, w.shape[-1])
            if self.scheme == "fp8":
                return quantize_fp8(flat, fp8_columns(flat.shape[1])).dequantize().view(w.shape)
            return torch.from_numpy(quantize(flat, self.scheme, self.device).dequantize()).view(w.shape)
        f = self.get_fp8(name, dim=dim, part=part)
        if f is not None:
            return f.dequantize()
        q = self.get_quant(name, dim=dim, part=part)
        if q is None:
            return self.src.get(name, dim=dim, part=part)
        return torch.from_numpy(q.dequantize())
