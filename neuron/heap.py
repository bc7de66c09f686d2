"""Giving freed memory back to the system: glibc keeps what a burst of allocations freed (a big
prompt parsed, a model's files read and refused) in its arenas unless asked to trim them."""

from __future__ import annotations

import ctypes
import ctypes.util


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim with
        return None


_TRIM = _malloc_trim()
AVAILABLE = _TRIM is not None


def trim() -> None:
    """Return the C heap's free memory to the system (nothing where the libc cannot)."""
    if _TRIM is not None:
        _TRIM(0)
