"""The names a loaded model answers to: its id, and its ``aliases`` (exact names and ``*`` globs,
e.g. ``claude-sonnet-4-5``, ``claude-*``), as ``[[models]] aliases``, ``POST /models/load`` and
``neuron load --alias`` set them. An exact name wins over a glob; ids over both."""

from __future__ import annotations

import fnmatch
from typing import Any, Iterable, TypeVar

from neuron.errors import ApiError

H = TypeVar("H")
GLOB = set("*?[")


def is_glob(name: str) -> bool:
    return bool(GLOB & set(name))


def find(models: dict[str, H], name: str) -> H | None:
    """The model ``name`` names among ``models`` (id -> handle with ``.entry.aliases``)."""
    handle = models.get(name)
    if handle is not None:
        return handle
    for handle in models.values():
        if name in _aliases(handle):
            return handle
    for handle in models.values():
        if any(is_glob(a) and fnmatch.fnmatchcase(name, a) for a in _aliases(handle)):
            return handle
    return None


def served(models: dict[str, H], name: str) -> H:
    """``find``'s model, or the 404 a route answers when none serves under ``name``."""
    handle = find(models, name)
    if handle is None:
        raise ApiError(404, "model_not_found", f"model {name!r} is not loaded", param="model")
    return handle


def _aliases(handle: Any) -> list[str]:
    return list(getattr(handle.entry, "aliases", None) or [])


def clash(model_id: str, aliases: Iterable[str], others: dict[str, Any]) -> str | None:
    """A name the model ``model_id`` would claim that one of ``others`` (id -> handle) claims
    already, or None."""
    aliases = list(aliases)
    for other_id, handle in others.items():
        if other_id == model_id:
            continue
        theirs = [other_id, *_aliases(handle)]
        for name in [model_id, *aliases]:
            for claim in theirs:
                if name == claim or (not is_glob(name) and is_glob(claim) and fnmatch.fnmatchcase(name, claim)) \
                        or (is_glob(name) and not is_glob(claim) and fnmatch.fnmatchcase(claim, name)):
                    return name
    return None
