"""What ``POST /models/load`` may read: the built-in model, the models the operator configured at
startup (by their path or id), ids of models already registered, Hugging Face repo ids found in
the local HF cache, and paths inside ``[server] model_roots``. Everything else gets one refusal,
the same status and bytes whether the path exists or not, so the route cannot be used to learn
anything about the host's files outside the roots."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from neuron.config import Config
from neuron.errors import ApiError
from neuron.loader.resolve import find_in_hf_cache, is_builtin
from neuron.loader.spec import model_id_for

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def refusal() -> ApiError:
    """The one answer to anything not allowed; it echoes nothing of the request."""
    return ApiError(404, "model_not_found",
                    "model not found: /models/load takes a model id, a Hugging Face repo id in the local cache, "
                    "or a path inside [server] model_roots", param="model")


@dataclass(frozen=True)
class Allowed:
    model: str  # what the Registry loads: as given, or the real path of a root's or the cache's files
    default_id: str | None = None  # the id when the request names none (None: the Registry's own rule)


@dataclass
class ModelAccess:
    roots: list[Path] = field(default_factory=list)  # real paths
    startup: dict[str, str] = field(default_factory=dict)  # a startup model's path or id -> its path
    hf_cache: str | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> ModelAccess:
        startup: dict[str, str] = {}
        for entry in cfg.models:
            startup[entry.model] = entry.model
            startup.setdefault(entry.id or model_id_for(entry.model), entry.model)
        roots = [Path(os.path.realpath(Path(r).expanduser())) for r in cfg.server.model_roots]
        return cls(roots=roots, startup=startup, hf_cache=cfg.runtime.hf_cache or None)

    def check(self, ref: str, registered: dict[str, str]) -> Allowed:
        """``registered``: id -> model of the models the Registry holds now (already vetted)."""
        if is_builtin(ref):
            return Allowed(ref)
        if ref in self.startup:
            return Allowed(self.startup[ref], None if ref == self.startup[ref] else ref)
        if ref in registered:
            return Allowed(registered[ref], ref)
        try:
            inside = self._inside_roots(ref)
        except (OSError, ValueError, RuntimeError):  # NUL byte, name too long, unknown ~user
            raise refusal() from None
        if inside is not None:
            return Allowed(str(inside), model_id_for(str(inside)))
        if _REPO_ID.fullmatch(ref) and ".." not in ref:
            snapshot = find_in_hf_cache(ref, self.hf_cache)
            if snapshot is not None:
                return Allowed(str(snapshot), ref)
        raise refusal()

    def _inside_roots(self, ref: str) -> Path | None:
        """The real path (symlinks resolved) of ``ref`` when it lies inside a root. An absolute
        path inside a root is taken even when missing (the loader then says so: inside the roots
        that reveals nothing); a relative one is the first that exists, looked up in each root."""
        given = Path(ref).expanduser()
        if given.is_absolute():
            real = Path(os.path.realpath(given))
            return real if self._contains(real) else None
        for root in self.roots:
            real = Path(os.path.realpath(root / given))
            if self._contains(real) and real.exists():
                return real
        return None

    def _contains(self, real: Path) -> bool:
        return any(real == root or real.is_relative_to(root) for root in self.roots)
