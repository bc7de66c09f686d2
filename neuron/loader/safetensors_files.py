"""Which safetensors files make up a checkpoint (no torch needed: the leader asks too)."""

from __future__ import annotations

import json
from pathlib import Path


def safetensors_files(directory: Path) -> list[Path]:
    """The files the sharded index names, else every ``*.safetensors`` in the directory."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    return sorted(directory.glob("*.safetensors"))
