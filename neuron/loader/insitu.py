"""In-situ quantization: a float checkpoint (bf16/fp16/fp32 safetensors, or a float GGUF) read
through a source that quantizes each projection weight as a rank reads its slice, so a rank
only ever quantizes (and holds) its own share."""

from __future__ import annotations

import torch

from neuron.models.quant import GROUP, SCHEMES, QuantWeight, quantize


def quantizable(name: str) -> bool:
    """Projection and vocabulary matrices; norms and the MoE router stay as they are."""
    return (name.endswith(".weight") and not name.endswith("norm.weight") and not name.endswith("mlp.gate.weight")
            and ".experts." not in name)


class QuantizingSource:
    def __init__(self, src, scheme: str) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown quantization {scheme!r} (known: {', '.join(SCHEMES)})")
        self.src, self.scheme = src, scheme
        self.quantized = True

    def has(self, name: str) -> bool:
        return self.src.has(name)

    def get_quant(self, name: str, *, dim: int | None = None, part: range | None = None) -> QuantWeight | None:
        if not quantizable(name):
            return None
        w = self.src.get(name, dim=dim, part=part)
        if w.ndim != 2 or w.shape[1] % GROUP:
            return None
        return quantize(w, self.scheme)

    def get(self, name: str, *, dim: int | None = None, part: range | None = None) -> torch.Tensor:
        """Floats; a quantizable weight comes back quantized and dequantized (the float32
        reference of the packed model)."""
        q = self.get_quant(name, dim=dim, part=part)
        if q is None:
            return self.src.get(name, dim=dim, part=part)
        return torch.from_numpy(q.dequantize())
