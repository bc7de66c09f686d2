"""Where neuron keeps what it computes once for a host (the tuner's choices, compiled kernels):
``$NEURON_CACHE_DIR/<kind>`` (default ``$XDG_CACHE_HOME/neuron``, else ``~/.cache/neuron``; an
empty ``NEURON_CACHE_DIR`` turns these caches off), each directory created 0700 and not used if
another user owns it or others may write to it (what is read from it is code or decides code)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("neuron")


def cache_dir(kind: str, env: dict[str, str] | None = None) -> Path | None:
    """The directory of ``kind``'s cache; None when ``NEURON_CACHE_DIR`` is set empty."""
    env = os.environ if env is None else env
    if "NEURON_CACHE_DIR" in env:
        root = env["NEURON_CACHE_DIR"]
        return Path(root) / kind if root else None
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "neuron" / kind


def private_dir(path: Path, what: str) -> bool:
    """``path`` made (0700) or found as a directory of ours that no one else may write to."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as exc:
        log.warning("%s %s unusable (%s)", what, path, exc)
        return False
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("%s %s not used: owned by another user or writable by others", what, path)
        return False
    return True
