"""Reads checkpoint tensors (or just a rank's slice of them) from safetensors files."""

from __future__ import annotations

import torch
from safetensors import safe_open


class SafetensorsSource:
    def __init__(self, paths: list[str]) -> None:
        self._files = {p: safe_open(p, framework="pt") for p in paths}
        self._where: dict[str, str] = {}
        for path, f in self._files.items():
            for name in f.keys():
                self._where[name] = path

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> list[int]:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return self._files[self._where[name]].get_slice(name).get_shape()

    def get(self, name: str, *, dim: int | None = None, part: range | None = None) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        f = self._files[self._where[name]]
        if part is None:
            return f.get_tensor(name)
        view = f.get_slice(name)
        index = [slice(None)] * len(view.get_shape())
        index[dim or 0] = slice(part.start, part.stop)
        return view[tuple(index)]

