"""The serving process's memory: giving freed memory back to the system (glibc keeps what a
burst of allocations freed, a big prompt parsed, a model's files read and refused, in its arenas
unless asked to trim them), and a garbage collector that stays out of the way of streams."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

# Once the startup models are in, every object made so far is frozen out of the collections and
# the youngest generation is collected every GEN0 allocations rather than 700. The leader at 256
# streams (scripts/perf-gpu --shape qwen3-tiny --device cpu --concurrency 256, 2-core machine,
# timed by gc.callbacks from ready on): 0.80 s of collections in the ~13 s level, the longest
# 70 ms (a full one over the startup heap); settled, 0.05 s, the longest 39 ms.
GEN0 = 10_000


def settle_collector() -> None:
    """Collect once, freeze what survives (the models' tokenizers, templates, configuration)
    so later collections never walk it, and collect the youngest generation less often."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GEN0, older, oldest)


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
