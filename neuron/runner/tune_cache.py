"""The load-time tuner's choices kept on disk, so that a second load of the same model on the same
GPU (or another model with the same weight shapes) times nothing: one JSON file per fingerprint of
what the choices depend on (the GPU, its SM count, CUDA, torch, Triton, neuron and the source of
its kernels and of the tuner), each choice keyed by the tuner, the weight's shape and format and
the row count. A choice read back is used only if it is one of the candidates the tuner would try
now; a file that does not parse is ignored (a log line) and rewritten. The directory is
``$NEURON_CACHE_DIR/tuning`` (default ``$XDG_CACHE_HOME/neuron``, else ``~/.cache/neuron``; an empty
``NEURON_CACHE_DIR`` turns the cache off), created 0700 and not used if others may write to it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from neuron import cache_dirs

log = logging.getLogger("neuron.runner")

Choice = tuple[int, ...] | None


def cache_dir(env: dict[str, str] | None = None) -> Path | None:
    """Where the tuner's choices are kept; None when ``NEURON_CACHE_DIR`` is set empty."""
    return cache_dirs.cache_dir("tuning", env)


def source_digest(files: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def fingerprint(device) -> dict[str, Any]:
    """What a choice depends on besides its shape: the GPU and the software that runs the kernels."""
    import torch
    import triton

    import neuron

    here = Path(__file__).resolve().parent
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "capability": list(torch.cuda.get_device_capability(device)),
            "sms": props.multi_processor_count, "cuda": torch.version.cuda, "torch": torch.__version__,
            "triton": triton.__version__, "neuron": neuron.__version__,
            "kernels": source_digest([*(here.parent / "kernels").glob("*.py"), *(here.parent / "kernels").glob("cuda/*.cu"),
                                      here / "linear.py"])}


class TuneCache:
    """The choices of one fingerprint: ``lookup`` before timing a shape, ``record`` after, ``save``
    once the tuner is done (merged with what another rank saved meanwhile)."""

    def __init__(self, directory: Path | None, identity: dict[str, Any]) -> None:
        self.identity = identity
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
        self.path = directory / f"{digest}.json" if directory is not None and cache_dirs.private_dir(directory, "tuning cache") else None
        self.choices: dict[str, Choice] = self._read() if self.path is not None else {}
        self.hits = self.misses = 0
        self._new: dict[str, Choice] = {}

    @classmethod
    def for_device(cls, device) -> "TuneCache":
        return cls(cache_dir(), fingerprint(device))

    def _read(self) -> dict[str, Choice]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("tuning cache %s unreadable (%s): ignored, rewritten after this load", self.path, exc)
            return {}
        ours = isinstance(data, dict) and data.get("fingerprint") == self.identity
        if not ours or not isinstance(data.get("choices"), dict):
            log.warning("tuning cache %s is not this fingerprint's: ignored, rewritten after this load", self.path)
            return {}
        return {k: tuple(v) if isinstance(v, list) else v for k, v in data["choices"].items()}

    def lookup(self, key: str, candidates: Iterable[tuple[int, ...]]) -> tuple[bool, Choice]:
        """(True, the choice) when ``key`` was tuned before and its choice is the default (None) or
        one of ``candidates``; (False, None) when it has to be timed."""
        if key in self.choices:
            choice = self.choices[key]
            if choice is None or choice in set(map(tuple, candidates)):
                self.hits += 1
                return True, choice
            log.warning("tuning cache: %s holds %r, not a candidate now: timed again", key, choice)
        self.misses += 1
        return False, None

    def record(self, key: str, choice: Choice) -> None:
        self.choices[key] = self._new[key] = tuple(choice) if choice is not None else None

    def save(self) -> None:
        if self.path is None or not self._new:
            return
        merged = {**self._read(), **self._new}
        body = json.dumps({"fingerprint": self.identity, "choices": {k: list(v) if v is not None else None
                                                                  for k, v in sorted(merged.items())}}, indent=1)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-")
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("tuning cache %s not written: %s", self.path, exc)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return
        self._new.clear()
