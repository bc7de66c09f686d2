"""A model's files, opened only where they really are allowed to be.

Whoever can write into a model directory must not be able to make the daemon read other files:
``chat_template.jinja`` as a symlink to the daemon's own TOML file would hand its keys to any API
user through ``/tokenize``. So every file a load opens is resolved (symlinks followed) and must
land inside one of the model's allowed directories: its own directory, the ``[server]
model_roots``, and for a Hugging Face cache snapshot the ``blobs`` directory its links point to,
as the cache lays them out. Anything else is refused by name before a byte of it is read.
Metadata files are read with a size bound, and a file that does not parse is a 422 naming it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron.errors import BadModelConfig, BadModelFile

MAX_METADATA_BYTES = 256 << 20  # a tokenizer.json of a 256k vocabulary is ~35 MB


def real_path(path: Path | str) -> Path:
    """``path`` with every symlink resolved; BadModelFile for a path that cannot be (a loop, a
    name too long, a NUL byte)."""
    try:
        return Path(os.path.realpath(path))
    except (OSError, ValueError, RuntimeError) as exc:  # RecursionError is a RuntimeError
        raise BadModelFile(f"{Path(str(path)).name[:200]!r} cannot be resolved: {type(exc).__name__}") from None


def allowed_dirs(directory: Path, roots: list[str] | tuple[str, ...] = ()) -> tuple[Path, ...]:
    """Where the files of ``directory`` may resolve: itself, the roots, and (for a snapshot of a
    Hugging Face cache, ``<repo>/snapshots/<rev>``) the repo's ``blobs``."""
    real = real_path(directory)
    allowed = [real, *(real_path(Path(r).expanduser()) for r in roots)]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        allowed.append(real.parent.parent / "blobs")
    return tuple(allowed)


@dataclass(frozen=True)
class ModelDir:
    directory: Path
    allowed: tuple[Path, ...]

    @classmethod
    def of(cls, directory: Path, roots: list[str] | tuple[str, ...] = ()) -> ModelDir:
        return cls(directory, allowed_dirs(directory, roots))

    def inside(self, path: Path) -> Path:
        """The real path of ``path`` (a file of this model), or BadModelFile when it resolves
        outside every allowed directory."""
        real = real_path(path)
        if not any(real == a or real.is_relative_to(a) for a in self.allowed):
            raise BadModelFile(f"{path.name} resolves outside the model's directory and [server] model_roots; "
                               "a model's files must lie inside them (add the real location to model_roots)")
        return real

    def file(self, name: str) -> Path | None:
        """The checked real path of the regular file ``name`` in the directory; None when there is
        none (a link outside is refused even when it leads nowhere)."""
        path = self.directory / name
        if not os.path.lexists(path):
            return None
        real = self.inside(path)
        return real if real.is_file() else None

    def read_json(self, name: str, *, required: bool = False) -> dict[str, Any]:
        """The JSON object in ``name`` ({} when absent and not required)."""
        path = self.file(name)
        if path is None:
            if required:
                raise BadModelConfig(f"the model has no {name}")
            return {}
        data = read_json_file(path, name)
        if not isinstance(data, dict):
            raise BadModelFile(f"{name} is not a JSON object")
        return data

    def read_text(self, name: str) -> str | None:
        path = self.file(name)
        return None if path is None else read_bounded(path, name).decode("utf-8", errors="replace")


def read_bounded(path: Path, name: str, limit: int = MAX_METADATA_BYTES) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise BadModelFile(f"{name} cannot be read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise BadModelFile(f"{name} is larger than {limit >> 20} MiB")
    return data


def read_json_file(path: Path, name: str) -> Any:
    try:
        return json.loads(read_bounded(path, name))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadModelFile(f"{name} does not parse: {exc}") from None
    except RecursionError:
        raise BadModelFile(f"{name} is nested too deeply") from None
