"""Whether a checkpoint sees images, and how: the settings of a Qwen3.5 model's vision tower, its
image processor and its image tokens, gathered into ``ModelConfig.vision`` (the leader counts
image tokens from them; every rank builds the tower from them). A model without all of them
(``vision_config``, the tower's ``model.visual.*`` tensors, ``preprocessor_config.json``) is
text-only, and ``missing`` says what it lacks for the 400 an image gets."""

from __future__ import annotations

from typing import Any

from neuron.errors import BadModelConfig
from .model_dir import ModelDir

VISION_TYPES = ("qwen3_5", "qwen3_5_moe")
TOWER_PREFIX = "model.visual."  # neuron.models.vision.TOWER_PREFIX (the loader has no torch)
DEFAULT_SECTIONS = [11, 11, 10]  # transformers' Qwen3.5 text rotary default


def vision_settings(raw: dict[str, Any], directory: ModelDir, tensor_names) -> dict[str, Any]:
    """``ModelConfig.vision`` of a config.json (empty: the model takes no images)."""
    if missing(raw, directory, tensor_names):
        return {}
    processor = directory.read_json("preprocessor_config.json")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    rope = text.get("rope_parameters") or {}
    sections = [int(x) for x in rope.get("mrope_section") or DEFAULT_SECTIONS]
    vision = raw["vision_config"]
    if int(vision.get("out_hidden_size", 0)) != int(text.get("hidden_size", -1)):
        raise BadModelConfig("vision_config.out_hidden_size differs from the text model's hidden_size")
    try:
        ids = {k: int(raw[k]) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}
    except (KeyError, TypeError, ValueError) as exc:
        raise BadModelConfig(f"config.json lacks the image token ids: {exc}") from None
    return {"config": vision, "processor": processor, "mrope_section": sections, **ids}


def missing(raw: dict[str, Any], directory: ModelDir, tensor_names) -> str:
    """What the checkpoint lacks to take images, in words ('' when nothing)."""
    if raw.get("model_type") not in VISION_TYPES or not isinstance(raw.get("vision_config"), dict):
        return "its architecture has no vision tower"
    if not any(name.startswith(TOWER_PREFIX) for name in tensor_names):
        return "its checkpoint holds no vision tower weights"
    if directory.file("preprocessor_config.json") is None:
        return "its checkpoint has no preprocessor_config.json"
    return ""
