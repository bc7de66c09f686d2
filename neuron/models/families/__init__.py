"""Model families: one module per family says how to read its config, which tensors it has, how
it splits across ranks, and builds one rank's model. The leader reads configs and checks splits
through this package without torch; only ``build`` (on a rank) imports it.

A family module has:

- ``MODEL_TYPES``: the config.json ``model_type`` values it serves;
- ``config_from_hf(raw, text) -> ModelConfig``: ``raw`` is config.json, ``text`` its text config
  (``raw["text_config"]`` where there is one); raises ``UnsupportedModel`` / ``BadModelConfig``;
- ``required_tensors(cfg) -> list[str]``: the Hugging Face tensor names a checkpoint must hold;
- ``check_split(cfg, world, block)``: raises ``ShardingError`` if ``world`` ranks cannot split it
  (``block``: the quant group packed weights split their input columns on);
- ``build(cfg, world, rank, src, *, dtype, device, max_len, block)``: one rank's model, an object
  with the interface of ``neuron.models.interface.Model``;
- optionally ``GGUF_ARCHS`` and ``config_from_gguf(arch, fields, tensor_names, n_tokens)``: the
  GGUF architectures it reads (``general.architecture``), and their metadata as a ModelConfig.

Adding a family adds its module and one line to ``BUILT_IN``. A family kept outside neuron is
named by its module in ``NEURON_FAMILIES`` (comma-separated), in the environment of the server
(its ranks inherit it).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from neuron.errors import UnsupportedModel

BUILT_IN: dict[str, str] = {
    "llama": "neuron.models.families.llama",
    "qwen3": "neuron.models.families.llama",
    "qwen3_moe": "neuron.models.families.llama",
    "qwen3_next": "neuron.models.families.qwen3_next",
    "qwen3_5_text": "neuron.models.families.qwen3_next",
    "qwen3_5_moe_text": "neuron.models.families.qwen3_next",
    "qwen3_5": "neuron.models.families.qwen3_next",
    "qwen3_5_moe": "neuron.models.families.qwen3_next",
}
PLUGINS_ENV = "NEURON_FAMILIES"


def modules() -> dict[str, str]:
    """Every served model_type and its family's module: the built-in ones, then those named in
    ``NEURON_FAMILIES``."""
    found = dict(BUILT_IN)
    for name in filter(None, (x.strip() for x in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            model_types = importlib.import_module(name).MODEL_TYPES
        except (ImportError, AttributeError) as exc:
            raise UnsupportedModel(f"{PLUGINS_ENV} names {name!r}, which is not a model family module: {exc}") from None
        for model_type in model_types:
            found[model_type] = name
    return found


def supported() -> list[str]:
    return list(modules())


# GGUF architectures read by a family module of their own (the llama family's are read in
# neuron.loader.model_config).
GGUF_BUILT_IN: dict[str, str] = {arch: "neuron.models.families.qwen3_next" for arch in ("qwen3next", "qwen35", "qwen35moe")}


def gguf_family(arch: str) -> ModuleType | None:
    name = GGUF_BUILT_IN.get(arch)
    return importlib.import_module(name) if name else None


def family(model_type: str) -> ModuleType | None:
    """The module of the family serving ``model_type``, or None."""
    name = modules().get(model_type)
    return importlib.import_module(name) if name else None
