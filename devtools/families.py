"""The test families a checkpoint can be written for, and the config and file helpers the
checkpoint and GGUF writers share."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES: tuple[str, ...] = ("llama", "qwen3", "qwen3_moe")
CONFIG_STYLES: tuple[str, ...] = ("hub", "rope_parameters")


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    hf_class: str
    gguf_arch: str
    # llama.cpp reorders q/k rows only for its "llama" arch (convert_hf_to_gguf.py LlamaModel.permute).
    permute_qk: bool


FAMILY_SPECS: dict[str, FamilySpec] = {
    "llama": FamilySpec("llama", "LlamaForCausalLM", "llama", True),
    "qwen3": FamilySpec("qwen3", "Qwen3ForCausalLM", "qwen3", False),
    "qwen3_moe": FamilySpec("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe", False),
}


def family_spec(family: str) -> FamilySpec:
    if family not in FAMILY_SPECS:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return FAMILY_SPECS[family]


def family_of(model_type: str) -> str:
    return next(family for family, spec in FAMILY_SPECS.items() if spec.model_type == model_type)


def to_hub_rope(config: dict[str, Any]) -> dict[str, Any]:
    rope = config.pop("rope_parameters", None)
    if rope is None:
        return config
    rope = dict(rope)
    config["rope_theta"] = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    return config


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def hub_names(config: dict[str, Any]) -> dict[str, Any]:
    config = dict(config)
    if "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")
    return config


def read_safetensors(out: Path) -> dict[str, np.ndarray]:
    """All tensors of the checkpoint in `out`, sharded or not."""
    from safetensors import safe_open

    index = out / "model.safetensors.index.json"
    files = sorted(set(read_json(index)["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors: dict[str, np.ndarray] = {}
    for filename in files:
        with safe_open(out / filename, framework="np") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
    return tensors


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")

def natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
