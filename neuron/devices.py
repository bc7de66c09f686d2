"""Which devices a model runs on, decided without importing CUDA in the leader."""

from __future__ import annotations

import glob
import os


def gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def choose_devices(device: str, tensor_parallel: int, devices: list[int]) -> list[str]:
    """Device strings for each rank; ``auto`` takes GPUs when there are enough of them."""
    if device == "auto":
        device = "cuda" if gpu_count() >= tensor_parallel else "cpu"
    if device == "cpu":
        return ["cpu"] * tensor_parallel
    ids = devices or list(range(tensor_parallel))
    if len(ids) != tensor_parallel:
        raise ValueError(f"{len(ids)} devices given for tensor_parallel={tensor_parallel}")
    available = gpu_count()
    if any(i >= available for i in ids):
        raise ValueError(f"devices {ids} asked for, but {available} GPU(s) are visible")
    return [f"cuda:{i}" for i in ids]


def default_dtype(devices: list[str], dtype: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if devices[0].startswith("cuda") else "float32"
