"""The instruction-set levels of the CPU kernels: what each is compiled with, what a CPU must
report to run it, and which one this CPU runs (the best it supports, or ``NEURON_CPU_ISA``).

The kernels (``csrc/``) are built once per level at install time (``setup.py``: ``pip install``
and ``scripts/setup``), as the modules ``neuron.kernels._cpu_<level>``; a rank imports the level
it runs and compiles nothing. As PyTorch chooses its ``CPU_CAPABILITY`` and llama.cpp its scored
backends. No torch and no neuron imports here: ``setup.py`` reads this file as it is.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

ENV = "NEURON_CPU_ISA"
ACTIVATIONS_ENV = "NEURON_CPU_ACTIVATIONS"


@dataclass(frozen=True)
class Level:
    name: str
    machine: str  # platform.machine() of the CPUs it is for
    flags: tuple[str, ...]  # the compiler's
    needs: tuple[str, ...]  # the CPU's, as /proc/cpuinfo names them ('flags' on x86, 'Features' on Arm)
    int8: bool = False  # its packed products can take x in integers: int16 (csrc/qblock.h), int8 (csrc/qdot.h)


# Best first. The portable level is plain C++ over the compiler's own vectors, for any CPU.
LEVELS = (
    Level("avx512vnni", "x86_64", ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-mavx2",
                                   "-mfma", "-mf16c"),
          ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"), int8=True),
    Level("avx512", "x86_64", ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"),
          ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c"), int8=True),
    Level("avx2vnni", "x86_64", ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), ("avx2", "fma", "f16c", "avx_vnni"),
          int8=True),
    Level("avx2", "x86_64", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"), int8=True),
    Level("neon", "aarch64", ("-march=armv8-a",), ("asimd", "fp")),
    Level("portable", "", (), ()),
)
# -Wno-*: GCC 12's own intrinsic headers (their `__Y = __Y` idiom) and the portable level's
# 32-byte vectors on a 16-byte ABI warn by the hundred, about nothing of ours.
COMMON_FLAGS = ("-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-Wno-maybe-uninitialized", "-Wno-uninitialized",
                "-Wno-psabi")


def module_name(level: str) -> str:
    return f"_cpu_{level}"


def levels_for(machine: str | None = None) -> list[Level]:
    """The levels built for a machine of this architecture, best first."""
    machine = machine or platform.machine()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine)
    return [lv for lv in LEVELS if lv.machine in ("", machine)]


def cpu_features(cpuinfo: str | None = None) -> set[str]:
    """What this CPU reports it can do (Linux's /proc/cpuinfo; empty elsewhere)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    features: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            features.update(value.split())
    return features


def runnable(features: set[str] | None = None, machine: str | None = None) -> list[Level]:
    """Every level this CPU can run, best first."""
    features = cpu_features() if features is None else features
    return [lv for lv in levels_for(machine) if all(f in features for f in lv.needs)]


class IsaError(ValueError):
    """A level that cannot run here was asked for."""


def choose(features: set[str] | None = None, forced: str | None = None, machine: str | None = None) -> Level:
    """The level to run: ``forced`` (``NEURON_CPU_ISA``) when this CPU has what it needs, else
    the best this CPU supports."""
    features = cpu_features() if features is None else features
    forced = os.environ.get(ENV, "").strip().lower() if forced is None else forced.strip().lower()
    candidates = levels_for(machine)
    if forced:
        names = [lv.name for lv in LEVELS]
        if forced not in names:
            raise IsaError(f"{ENV}={forced!r} is not a level (one of {', '.join(names)})")
        level = next((lv for lv in candidates if lv.name == forced), None)
        if level is None:
            raise IsaError(f"{ENV}={forced}: this is a {platform.machine()} machine; its levels are "
                           f"{', '.join(lv.name for lv in candidates)}")
        missing = [f for f in level.needs if f not in features]
        if missing:
            raise IsaError(f"{ENV}={forced}: this CPU lacks {', '.join(missing)}")
        return level
    return runnable(features, machine)[0]


def activations(level: Level, forced: str | None = None) -> str:
    """How the packed products of ``level`` take x: ``int16`` per group of 32 where the level has
    integer products (the default there: within 1 part in 65,534 of each group's largest value,
    the float32 path's answers at integer speed), ``int8`` per group of 32 as llama.cpp's CPU
    backend does, or ``float32`` (the default elsewhere: what the dequantized weights compute), as
    ``NEURON_CPU_ACTIVATIONS`` (``forced``) asks; an integer form on a level without it is refused
    by name."""
    forced = os.environ.get(ACTIVATIONS_ENV, "").strip().lower() if forced is None else forced.strip().lower()
    if forced not in ("", "int16", "int8", "float32"):
        raise IsaError(f"{ACTIVATIONS_ENV}={forced!r} is not one of int16, int8, float32")
    if forced in ("int16", "int8") and not level.int8:
        raise IsaError(f"{ACTIVATIONS_ENV}={forced}: the {level.name} kernels multiply in float32 only")
    return forced or ("int16" if level.int8 else "float32")
