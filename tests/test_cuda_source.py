"""The CUDA C++ kernels compile, on any host where NVRTC loads (the test extra installs it; no GPU
needed): every variant the 4-bit product's tuner may pick, for Hopper (sm_90) and Ampere (sm_80),
and the default variants without a register spilled on Hopper (ptxas's own report). So a change to
``neuron/kernels/cuda/`` that breaks a variant fails here, not on the first GPU that loads it."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined (packed_mma imports Triton's)
pytest.importorskip("triton")

from neuron.kernels import nvrtc  # noqa: E402
from neuron.kernels import packed_mma as pm  # noqa: E402

pytestmark = pytest.mark.skipif(nvrtc.compiler_version() is None, reason="NVRTC does not load here")


def _names(shapes) -> list[str]:
    return [f"w4mma<{a}, {m}, {d}, {w}, {b}, {f16}, {split}, {wide}>" for a, m, d, w, b in shapes
            for f16 in ("false", "true") for split in ("false", "true") for wide in ("false", "true")]


def _compile(name_arch: tuple[str, str]) -> tuple[str, str, str]:
    name, arch = name_arch
    source = (nvrtc.SOURCES / "w4mma.cu").read_text()
    image, lowered, log = nvrtc.compile_source(source, name, arch, verbose=True)
    assert image[:4] == b"\x7fELF" and lowered.startswith("_Z5w4mma"), name
    return name, arch, log


def test_every_variant_compiles_and_the_defaults_spill_nothing():
    jobs = [(n, "sm_90") for n in _names(pm.MMA_SHAPES)] + [(n, "sm_80") for n in _names(pm.MMA_CONFIG.values())]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(_compile, jobs))
    defaults = set(_names(pm.MMA_CONFIG.values()))
    for name, arch, log in results:
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
        assert spills, log  # ptxas reported on the kernel
        if name in defaults and arch == "sm_90":  # the configs measured on an H200
            assert max(spills) == 0, (name, arch, log)


def test_a_broken_source_is_refused_with_the_compiler_s_words():
    with pytest.raises(nvrtc.CudaKernelError, match="did not compile"):
        nvrtc.compile_source("template <int N> __global__ void k() { undeclared_thing(); }", "k<1>", "sm_90")
