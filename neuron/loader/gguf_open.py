"""The GGUF weight source for a model: llama.cpp's layout of its family read back as the
checkpoint it was converted from."""

from __future__ import annotations

from .gguf_file import HYBRID_ARCHS, GgufFile
from .gguf_hybrid import HybridGgufSource
from .gguf_source import GgufSource


def open_gguf(path: str, config) -> GgufSource:
    """The hybrid family's source undoes what llama.cpp's converter did to its tensors
    (``gguf_hybrid``); the others' undoes llama's q/k permutation (``gguf_source``)."""
    if str(GgufFile(path, read_tensors=False).fields.get("general.architecture")) in HYBRID_ARCHS:
        return HybridGgufSource(path, config)
    return GgufSource(path, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
