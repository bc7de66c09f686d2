"""Kernels written in CUDA C++ (``neuron/kernels/cuda/*.cu``), compiled at their first use by NVRTC
(the ``libnvrtc`` that CUDA builds of torch install, or a CUDA toolkit's) into a cubin for the
GPU at hand, kept on disk (``$NEURON_CACHE_DIR/cuda``, keyed by the source, the kernel, the GPU's
architecture and NVRTC's version), and launched through the CUDA driver API with ctypes on
torch's current stream, so CUDA graphs capture them like any kernel. No nvcc, no torch headers:
nothing here is tied to a torch version. ``available()`` says whether this host can (else the
callers keep their Triton kernels)."""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from neuron import cache_dirs

log = logging.getLogger("neuron.kernels")

SOURCES = Path(__file__).parent / "cuda"


class CudaKernelError(RuntimeError):
    pass


def _candidates() -> list[str]:
    found = []
    try:
        import nvidia  # the CUDA wheels torch depends on (nvidia/cu13/lib, nvidia/cuda_nvrtc/lib)
        for root in nvidia.__path__:
            found += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")), reverse=True)
    except ImportError:
        pass
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    return [p for p in found if "builtins" not in os.path.basename(p)] + ["libnvrtc.so"]


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    errors = []
    for path in _candidates():
        try:
            for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        return lib
    raise CudaKernelError("no libnvrtc found (" + "; ".join(errors) + ")")


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    return lib


def _check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status:
        if lib is _driver():
            text = ctypes.c_char_p()
            lib.cuGetErrorString(status, ctypes.byref(text))
            raise CudaKernelError(f"{what}: CUDA error {status} ({(text.value or b'').decode()})")
        raise CudaKernelError(f"{what}: NVRTC error {status} ({lib.nvrtcGetErrorString(status).decode()})")


@functools.cache
def available() -> bool:
    """NVRTC and the driver load, and torch sees a GPU of compute capability 8.0 or later."""
    if not torch.cuda.is_available() or os.environ.get("NEURON_CUDA_KERNELS", "1") == "0":
        return False
    try:
        _nvrtc(), _driver()
    except (OSError, CudaKernelError) as exc:
        log.warning("CUDA C++ kernels unavailable (%s): the Triton kernels run instead", exc)
        return False
    return torch.cuda.get_device_capability()[0] >= 8


def compiler_version() -> str | None:
    """NVRTC's version where it loads (no GPU needed), else None."""
    try:
        return _version()
    except (OSError, CudaKernelError):
        return None


def _version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_nvrtc(), _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return f"{major.value}.{minor.value}"


def _log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    text = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, text)
    return text.value.decode(errors="replace")


def compile_source(source: str, name: str, arch: str, verbose: bool = False) -> tuple[bytes, str, str]:
    """``name`` of ``source`` compiled for ``arch`` (``sm_90``): its cubin, its lowered name and
    NVRTC's log (with ``verbose``, ptxas's registers and spills of each kernel)."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None), "create")
    try:
        _check(lib, lib.nvrtcAddNameExpression(prog, name.encode()), "name")
        opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device", "--fmad=true"]
        opts += ["--ptxas-options=-v"] if verbose else []
        array = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        if lib.nvrtcCompileProgram(prog, len(opts), array):
            raise CudaKernelError(f"{name} did not compile:\n{_log(lib, prog)}")
        lowered = ctypes.c_char_p()
        _check(lib, lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)), "lowered name")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        image = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, image), "cubin")
        return image.raw, lowered.value.decode(), _log(lib, prog) if verbose else ""
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _current_context(device: torch.device) -> None:
    """The device's primary context (torch's) current on this thread, as the module calls need."""
    drv = _driver()
    ctx = ctypes.c_void_p()
    _check(drv, drv.cuCtxGetCurrent(ctypes.byref(ctx)), "current context")
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = ctypes.c_int()
    _check(drv, drv.cuDeviceGet(ctypes.byref(handle), index), "device")
    if ctx.value:
        current = ctypes.c_int()
        _check(drv, drv.cuCtxGetDevice(ctypes.byref(current)), "context's device")
        if current.value == handle.value:
            return
    torch.cuda.init()
    _check(drv, drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle), "primary context")
    _check(drv, drv.cuCtxSetCurrent(ctx), "set context")


def _cubin(file: str, name: str, arch: str) -> tuple[bytes, str]:
    """The cubin of ``name`` and its lowered name: from the cache where a file there holds them
    whole (its SHA-256 recorded beside it), else compiled (and cached)."""
    source = (SOURCES / file).read_text()
    key = hashlib.sha256("\0".join([source, name, arch, _version()]).encode()).hexdigest()[:32]
    folder = cache_dirs.cache_dir("cuda")
    if folder is not None and not cache_dirs.private_dir(folder, "CUDA kernel cache"):
        folder = None
    if folder is not None:
        try:
            image = (folder / f"{key}.cubin").read_bytes()
            lowered, digest = (folder / f"{key}.name").read_text().split("\n")[:2]
            if hashlib.sha256(image).hexdigest() == digest:
                return image, lowered
            log.warning("CUDA kernel %s: the cached cubin %s is damaged; compiled again", name, folder / f"{key}.cubin")
        except (OSError, ValueError):
            pass
    image, lowered, _ = compile_source(source, name, arch)
    if folder is not None:
        try:
            for suffix, data in ((".cubin", image), (".name", f"{lowered}\n{hashlib.sha256(image).hexdigest()}\n".encode())):
                tmp = folder / f"{key}{suffix}.{os.getpid()}"
                tmp.write_bytes(data)
                tmp.replace(folder / f"{key}{suffix}")
        except OSError as exc:
            log.warning("CUDA kernel cache %s not written (%s)", folder, exc)
    return image, lowered


_lock = threading.Lock()


class Kernel:
    """``name`` (a template instance of ``file``'s, e.g. ``w4mma<2, 1, 2, 4, 3, false, true, false>``)
    on one device."""

    def __init__(self, file: str, name: str, device: torch.device):
        major, minor = torch.cuda.get_device_capability(device)
        image, lowered = _cubin(file, name, f"sm_{major}{minor}")
        drv = _driver()
        _current_context(device)
        self.module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
        _check(drv, drv.cuModuleLoadData(ctypes.byref(self.module), image), f"load {name}")
        _check(drv, drv.cuModuleGetFunction(ctypes.byref(self.function), self.module, lowered.encode()),
               f"find {name}")
        self.name = name

    def __call__(self, grid: tuple[int, int, int], block: int, args: list, stream: int) -> None:
        values = [a if isinstance(a, (ctypes.c_void_p, ctypes.c_int, ctypes.c_long)) else ctypes.c_void_p(a.data_ptr())
                  for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        drv = _driver()
        _check(drv, drv.cuLaunchKernel(self.function, grid[0], grid[1], grid[2], block, 1, 1, 0,
                                       ctypes.c_void_p(stream), params, None), f"launch {self.name}")


@functools.cache
def _kernel(file: str, name: str, device: torch.device) -> Kernel:
    return Kernel(file, name, device)


def kernel(file: str, name: str, device: torch.device) -> Kernel:
    """The compiled ``name`` on ``device`` (compiled or read from the cache once per process)."""
    with _lock:
        return _kernel(file, name, device)
