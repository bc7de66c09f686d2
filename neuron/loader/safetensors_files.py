"""Which safetensors files make up a checkpoint (no torch needed: the leader asks too)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from .errors import BadModelConfig, LoadError

INDEX = "model.safetensors.index.json"


def safetensors_files(directory: Path) -> list[Path]:
    """The files the sharded index names, else every ``*.safetensors`` in the directory."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted({str(name) for name in weight_map.values()})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadModelConfig(f"{INDEX} does not parse: {exc}") from None
        except (KeyError, TypeError, AttributeError):
            raise BadModelConfig(f"{INDEX} has no weight_map object naming the shard files") from None
        if any("/" in name or name.startswith(".") for name in names):
            raise BadModelConfig(f"{INDEX} names a file outside the model directory")
        return [directory / name for name in names]
    return sorted(directory.glob("*.safetensors"))


def check_safetensors_header(path: Path) -> set[str]:
    """Refuse a file that cannot be a safetensors file (truncated, empty, another format)
    before any rank tries to map it: 8 bytes of header length, then that much JSON. Returns the
    names of the tensors it holds."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoadError(f"{path.name} is not a safetensors file ({size} bytes)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8 or length > 100_000_000:
                raise LoadError(f"{path.name} is not a safetensors file or is truncated "
                                f"(header of {length} bytes in a file of {size})")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise LoadError(f"{path.name} cannot be read: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LoadError(f"{path.name} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise LoadError(f"{path.name} is not a safetensors file (its header is not a JSON object)")
    end = max((int(v["data_offsets"][1]) for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if 8 + length + end > size:
        raise LoadError(f"{path.name} is truncated: its tensors need {8 + length + end} bytes, "
                        f"the file has {size}")
    return {k for k in header if k != "__metadata__"}
