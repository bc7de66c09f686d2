"""What every node must agree on before a load: the neuron version and the model's files (its
parsed config and every tensor's name, dtype and shape), so that a node with other weights or
another release is refused by name instead of computing something else."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import msgspec

from neuron import __version__

VERSION = __version__


def _tensors(path: Path, fmt: str) -> list[list]:
    if fmt == "gguf":
        from neuron.loader.gguf_file import GgufFile

        gguf = GgufFile(path, read_tensors=False)
        return sorted([name, t.qtype.name, list(t.shape)] for name, t in gguf.tensors.items())
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sorted([name, info.get("dtype"), info.get("shape")] for name, info in header.items()
                  if name != "__metadata__" and isinstance(info, dict))


def model_fingerprint(spec) -> str:
    """A hash of ``spec`` (a loader ModelSpec): config, quantization and tensor index."""
    digest = hashlib.sha256(msgspec.msgpack.encode(spec.config))
    digest.update(msgspec.msgpack.encode(spec.checkpoint_quant))
    for path in spec.files.paths:
        digest.update(json.dumps(_tensors(Path(path), spec.files.format)).encode())
    return digest.hexdigest()[:32]
