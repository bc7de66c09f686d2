"""Large zeroed buffers on the CPU, taken from the kernel as they are first touched.

``torch.zeros`` writes every byte at once: a CPU rank's KV cache (max_slots x max_model_len
tokens, 0.75 GiB for the default model, 3.5 GiB for a 1.7B one) cost 0.4-5 s of every start,
for pages most runs never use. An anonymous mapping reads as zeros and costs a page only when a
sequence first writes it. So that the cost is not moved to an out-of-memory kill mid-stream,
a buffer larger than the memory the host has available is refused when it is made.
"""

from __future__ import annotations

import math
import mmap
import weakref

import torch


def available_bytes() -> int:
    """MemAvailable: free memory plus what the kernel can reclaim (the page cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def zeroed(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, what: str = "buffer") -> torch.Tensor:
    """A zeroed tensor; on the CPU backed by an anonymous mapping (zero pages until written)."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    return mapped(shape, dtype, what, "lower max_slots, max_model_len or kv_cache_tokens")


def mapped(shape: tuple[int, ...], dtype: torch.dtype, what: str, remedy: str) -> torch.Tensor:
    """A zeroed CPU tensor over an anonymous mapping of exactly its bytes, refused (``remedy``
    says what to lower) where the host has not that much memory available."""
    count = math.prod(shape)
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    free = available_bytes()
    if nbytes > free:
        raise torch.OutOfMemoryError(
            f"the {what} needs {nbytes / 2**30:.2f} GiB and this host has {free / 2**30:.2f} GiB available: {remedy}")
    if not count:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)


class Pinned:
    """A CPU tensor the GPU copies to and from asynchronously (``.tensor``): ``mapped``, then
    page-locked in place with cudaHostRegister, until ``release`` or until it is collected
    (before its mapping can go: a new mapping at the same address could not be registered).
    Not torch's pinned allocator: it rounds every allocation up to a power of two, so a host tier
    of 48 GB took 64 GiB of locked memory, and one of 80 GB asked for 128 GiB and failed on a
    128 GiB host."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, what: str, remedy: str) -> None:
        self.tensor = mapped(shape, dtype, what, remedy)
        nbytes = self.tensor.numel() * self.tensor.element_size()
        self._unlock = None
        if nbytes:
            fault_in(self.tensor)
            cudart = torch.cuda.cudart()
            err = int(cudart.cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            if err:
                clear_cuda_error()
                raise torch.OutOfMemoryError(f"the {what}'s {nbytes / 2**30:.2f} GiB could not be page-locked "
                                             f"(cudaHostRegister: CUDA error {err}): {remedy}")
            self._unlock = weakref.finalize(self, cudart.cudaHostUnregister, self.tensor.data_ptr())

    def release(self) -> None:
        """Unlock the pages (the tensor stays usable as plain memory)."""
        if self._unlock is not None:
            self._unlock()


def fault_in(tensor: torch.Tensor) -> None:
    """Every page of ``tensor`` taken from the kernel now, by as many threads as the host has
    cores: cudaHostRegister (like mlock) faults in what is missing on one thread, which is most of
    its time."""
    import os

    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, os.cpu_count() or 1))
    try:
        tensor.zero_()
    finally:
        torch.set_num_threads(threads)


def clear_cuda_error() -> None:
    """Take back the CUDA runtime's last error (a failed cudaHostRegister leaves it, and torch
    would raise it at its next check of some unrelated call)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            path = next((line.split()[-1] for line in f if "libcudart" in line), None)
        if path:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass
