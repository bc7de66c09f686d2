"""Which safetensors files make up a checkpoint (no torch needed: the leader asks too)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from neuron.errors import BadModelConfig, BadModelFile
from .model_dir import ModelDir

INDEX = "model.safetensors.index.json"


def safetensors_files(d: ModelDir) -> list[Path]:
    """The real paths of the files the sharded index names, else of every ``*.safetensors`` in
    the directory; each checked to resolve where the model's files may."""
    index = d.read_json(INDEX)
    if index:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise BadModelConfig(f"{INDEX} has no weight_map object naming the shard files")
        names = sorted(set(weight_map.values()))
        if any("/" in name or "\\" in name or name.startswith(".") or "\0" in name for name in names):
            raise BadModelConfig(f"{INDEX} names a file outside the model directory")
        return [d.inside(d.directory / name) for name in names]
    return [d.inside(path) for path in sorted(d.directory.glob("*.safetensors"))]


# Bits per element of each dtype the format names (safetensors' own list).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
              "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "C64": 64, "F4": 4,
              "F6_E2M3": 6, "F6_E3M2": 6}
MAX_HEADER_BYTES = 100_000_000


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _check_entry(name: str, info, data_bytes: int, file: str) -> None:
    """One tensor's header entry, checked as safetensors' own reader checks it."""
    if not isinstance(info, dict):
        raise BadModelFile(f"{file}: the header entry of {name[:100]!r} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise BadModelFile(f"{file}: tensor {name[:100]!r} has an unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_is_count(n) for n in shape):
        raise BadModelFile(f"{file}: tensor {name[:100]!r} has a malformed shape")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(n) for n in offsets):
        raise BadModelFile(f"{file}: tensor {name[:100]!r} has malformed data_offsets")
    begin, end = offsets
    if end > data_bytes:
        raise BadModelFile(f"{file} is truncated: tensor {name[:100]!r} ends at byte {end} of its data, "
                           f"the file holds {data_bytes}")
    elements = 1
    for n in shape:
        elements *= n
    if begin > end or (end - begin) * 8 != elements * DTYPE_BITS[dtype]:
        raise BadModelFile(f"{file}: tensor {name[:100]!r} does not fit its data_offsets "
                           f"({begin}..{end} for {elements} {dtype} values in {data_bytes} bytes of data)")


def check_safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Refuse a file that cannot be a safetensors file (truncated, empty, another format, a
    header whose entries do not describe its data) before any rank tries to map it: 8 bytes of
    header length, then that much JSON. Returns the shapes of the tensors it holds, by name."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BadModelFile(f"{path.name} is not a safetensors file ({size} bytes)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8 or length > MAX_HEADER_BYTES:
                raise BadModelFile(f"{path.name} is not a safetensors file or is truncated "
                                f"(header of {length} bytes in a file of {size})")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise BadModelFile(f"{path.name} cannot be read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadModelFile(f"{path.name} is not a safetensors file (its header is not JSON)") from None
    except RecursionError:
        raise BadModelFile(f"{path.name}: its header is nested too deeply") from None
    if not isinstance(header, dict):
        raise BadModelFile(f"{path.name} is not a safetensors file (its header is not a JSON object)")
    data_bytes = size - 8 - length
    for name, info in header.items():
        if name != "__metadata__":
            _check_entry(name, info, data_bytes, path.name)
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
