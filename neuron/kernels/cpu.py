"""The CPU kernels: packed-weight matrix products (``csrc/qlinear_cpu.cpp``) and the step's fused
small ops (``csrc/cpu_ops.cpp``), one extension built for this machine's
instruction set the first time a rank needs them (torch's C++ extension builder: a C++ compiler
and ninja) and cached by torch under ``TORCH_EXTENSIONS_DIR`` (default ~/.cache/torch_extensions)."""

from __future__ import annotations

import fcntl
import functools
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("neuron.kernels")

NAME = "neuron_cpu"
SOURCES = [Path(__file__).parent / "csrc" / "qlinear_cpu.cpp", Path(__file__).parent / "csrc" / "cpu_ops.cpp"]


class KernelUnavailable(RuntimeError):
    """The CPU kernels could not be built here."""


def cpu_kernels() -> Any:
    """The built module (``q4_linear``, ``q8_linear``; ``rms_norm``, ``add_rms_norm``, ``silu_mul``,
    ``rope_store``, ``paged_decode``), or KernelUnavailable (tried once)."""
    result = _build()
    if isinstance(result, KernelUnavailable):
        raise result
    return result


@functools.cache
def _build() -> Any:
    from torch.utils.cpp_extension import _get_build_directory, load

    t0 = time.perf_counter()
    try:
        build = Path(_get_build_directory(NAME, verbose=False))
        # torch's own build lock is a plain file: one left by a process killed while it built
        # would make every later build wait for ever. Builds take this flock first (the kernel
        # drops it when its holder dies), so a torch lock found under it is a dead build's.
        with open(build / "neuron.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            mod = load(name=NAME, sources=[str(s) for s in SOURCES],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, an assembler without AVX-512, ...
        return KernelUnavailable(f"the packed-weight CPU kernels could not be built: {exc}")
    log.info("packed-weight CPU kernels ready in %.1fs", time.perf_counter() - t0)
    return mod
