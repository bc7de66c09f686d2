"""Config reading every family shares (no torch)."""

from __future__ import annotations

from typing import Any

from neuron.errors import UnsupportedModel

ROPE_SCALINGS = ("linear", "llama3", "yarn")  # what neuron.models.layers.rope_inv_freq computes


def clean_scaling(scaling: Any) -> dict[str, float | str | int] | None:
    """A config's RoPE scaling as ModelConfig keeps it (None: the default), or UnsupportedModel."""
    if not isinstance(scaling, dict):
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALINGS:
        raise UnsupportedModel(f"rope scaling {kind!r} is not supported (supported: default, {', '.join(ROPE_SCALINGS)})")
    out = {k: v for k, v in scaling.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    out["rope_type"] = str(kind)
    return out


def rope_of(text: dict[str, Any]) -> tuple[float, dict[str, float | str | int] | None]:
    """(rope_theta, rope_scaling) of a text config, hub style or ``rope_parameters`` style."""
    rope = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling")
    if rope and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return float(rope.get("rope_theta", text.get("rope_theta", 10000.0))), clean_scaling(scaling)
