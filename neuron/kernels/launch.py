"""What every Triton kernel of neuron launches with: programmatic dependent launch (PDL) and
the grid sync that goes with it, the interpreter switch, and small launch helpers."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # as Triton reads it, at import


_pdl_on = True


def pdl_by_default(on: bool) -> None:
    """Whether ``pdl`` is on where ``NEURON_PDL`` does not say. The runner turns it off on
    tensor-parallel ranks: there one of six runs of the TP=2 test against the CPU failed with it,
    cause not seen, so it waits for a proof (``NEURON_PDL=1`` turns it on)."""
    global _pdl_on
    _pdl_on = on
    pdl.cache_clear()


@functools.cache
def pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with programmatic dependent launch (PDL, Hopper
    and later; ``NEURON_PDL=0`` turns it off, ``=1`` on): a kernel then starts while the one before
    it in the stream is still running, instead of after it has drained, and waits
    (``grid_sync``) only where it needs that kernel's results. A decode step is ~330 short
    kernels, so the gaps and the ramps between them are a good part of it; a projection also
    fetches its first weights (which no kernel writes) before it waits."""
    wanted = os.environ.get("NEURON_PDL", "1" if _pdl_on else "0") != "0"
    if INTERPRETED or device.type != "cuda" or not wanted:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_args(device: torch.device) -> dict[str, bool]:
    """The launch arguments of a kernel that calls ``grid_sync(PDL)``."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def grid_sync(PDL: tl.constexpr):
    """Under PDL: let the next kernel of the stream launch, then wait until the previous one has
    finished and its writes are visible. Every program calls this before it reads anything an
    earlier kernel of the chain writes or writes anything, and before it may exit (the wait is
    what makes the chain transitive: a kernel finishes only after the one before it has).

    What may be read before it: what no kernel of the chain writes — weights, tables of
    constants, and a step's inputs, which copies and torch ops write before the chain's first
    kernel (launched without PDL, those finish before any later kernel starts). A kernel of the
    chain may start while several before it still run, so not even a write several kernels back
    is safe to read before the wait."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dot_precision(activations: torch.dtype) -> str:
    """``tl.dot``'s precision for float32 inputs: tf32 for a 16-bit model (10 bits of mantissa,
    more than its activations hold), full float32 for a float32 one (Triton's default is tf32)."""
    return "ieee" if INTERPRETED or activations == torch.float32 else "tf32"


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


@functools.cache
def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory a program may use on ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
