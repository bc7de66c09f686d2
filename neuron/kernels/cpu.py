"""The CPU kernels: packed-weight matrix products and the step's fused small ops (``csrc/``),
built at install time once per instruction-set level (``isa.py``, ``setup.py``); the level this
CPU runs best, or ``NEURON_CPU_ISA``, is imported once per process. Nothing is compiled here.
Packed products take x in int16 where the level has integer products (the weight's bytes then
reordered in place into blocks of 16 rows, ``csrc/qblock.h``), in int8 or float32 where asked
(``isa.activations``, ``NEURON_CPU_ACTIVATIONS``).

The modules take their operands' addresses; these wrappers check the tensors first (dtype,
layout, shapes: what the C++ would otherwise read past) and pass them on. A packed weight's
tensors are checked once, when it is bound (``PackedKernel``); a product then checks only ``x``.

A product of many rows of float32 x (``GEMM_ROWS`` or more: a prompt's chunk; int16 x takes every
row count in its blocks, at integer speed) has W dequantized
(``dequant``: each value as the packed products compute it) into a scratch buffer, a panel of at
most ``PANEL_BYTES`` at a time, and multiplied by torch's own GEMM, whose blocking the packed
kernels' eight rows at a time do not have.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

import torch

from . import isa

log = logging.getLogger("neuron.kernels")
GEMM_ROWS = 96
PANEL_BYTES = 32 << 20
BLOCK_ROWS = 16  # rows of W a block of the int16 products holds (csrc/qblock.h)


class KernelUnavailable(RuntimeError):
    """The CPU kernels are not there (not built: no compiler at install time) or cannot run."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _f32(t: torch.Tensor, name: str) -> None:
    _check(t.dtype == torch.float32 and t.is_cpu, f"{name} must be a float32 CPU tensor")


class PackedKernel:
    """``y = x W^T`` for one packed W (``models.packed_linear``): u uint8 [N, K * bits / 8];
    s, m float16 [N, ns] (d, dm empty), or int8 [N, ns] with d, dm float16 [N, nd]; ns = K/32 or
    K/16. With int16 ``activations`` and N a multiple of 16, the kernel computes from copies of
    them in blocks of 16 rows (``blocked``; ``tensors``): their owner keeps those instead, and
    reads rows through ``rows``, not their bytes."""

    def __init__(self, mod: Any, bits: int, u: torch.Tensor, s: torch.Tensor, m: torch.Tensor, d: torch.Tensor,
                 dm: torch.Tensor, activations: str, scratch: Scratch) -> None:
        N = u.shape[0]
        K = u.shape[1] * 8 // bits
        sup = d.numel() > 0
        _check(u.dtype == torch.uint8 and u.is_contiguous() and u.dim() == 2 and K % 32 == 0, "u does not match x")
        _check(s.dtype == (torch.int8 if sup else torch.float16) and m.dtype == s.dtype and s.dim() == 2
               and s.shape[0] == N and m.shape == s.shape and s.is_contiguous() and m.is_contiguous(),
               "scales do not match u")
        ns = s.shape[1]
        _check(ns in (K // 32, K // 16), "a scale per 32 or per 16 values")
        nd = 0
        if sup:
            _check(d.dtype == torch.float16 and dm.shape == d.shape and d.dim() == 2 and d.shape[0] == N
                   and ns % d.shape[1] == 0 and d.is_contiguous() and dm.is_contiguous(),
                   "super-block scales do not match")
            nd = d.shape[1]
        self.mod, self.bits, self.n, self.k = mod, bits, N, K
        self.ns, self.nd = ns, nd
        self.int8 = activations == "int8"
        self.blocked = activations == "int16" and N % BLOCK_ROWS == 0  # else float32 x: the same answers
        self.scratch = scratch
        self._bind((u, s, m, d, dm))
        if self.blocked:
            self._bind(self._blocks())

    def _bind(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors  # the addresses below stay theirs
        u, s, m, d, dm = tensors
        sup = self.nd > 0
        self.args = (u.data_ptr(), s.data_ptr(), m.data_ptr(), d.data_ptr() if sup else 0, dm.data_ptr() if sup else 0)

    def _blocks(self) -> tuple[torch.Tensor, ...]:
        """Copies of the bound tensors in blocks of 16 rows (``csrc/qblock.h``)."""
        blocked = tuple(torch.empty_like(t) for t in self.tensors)
        outs = [t.data_ptr() if t.numel() else 0 for t in blocked]
        self.mod.to_blocks(self.bits, *self.args, self.n, self.k, self.ns, self.nd, *outs, torch.get_num_threads())
        return blocked

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        M, K = x.shape
        _check(x.dtype == torch.float32 and K == self.k and x.is_cpu, "x must be float32 [M, K] on the CPU")
        if not x.is_contiguous():
            x = x.contiguous()
        if M >= GEMM_ROWS and not (self.int8 or self.blocked):
            return self.gemm(x)
        y = torch.empty(M, self.n, dtype=torch.float32)
        self.mod.qlinear(self.bits, x.data_ptr(), *self.args, y.data_ptr(), M, self.k, self.n, self.ns, self.nd,
                         torch.get_num_threads(), 2 if self.blocked else int(self.int8))
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 [T]) of a blocked W, dequantized: float32 [T, K]."""
        ids = ids.to(torch.int64).contiguous()
        _check(self.blocked and ids.dim() == 1, "rows of a blocked W by a 1-d index")
        _check(ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < self.n), "a row index out of range")
        out = torch.empty(ids.numel(), self.k, dtype=torch.float32)
        self.mod.dequant16(self.bits, *self.args, out.data_ptr(), self.k, 0, ids.data_ptr(), ids.numel(), self.ns,
                           self.nd, torch.get_num_threads())
        return out

    def dequantized(self, n0: int, n1: int) -> torch.Tensor:
        """Rows n0..n1 of W as float32, in the scratch buffer (valid until its next use)."""
        w = self.scratch.take((n1 - n0) * self.k).view(n1 - n0, self.k)
        if self.blocked:
            self.mod.dequant16(self.bits, *self.args, w.data_ptr(), self.k, n0, 0, n1 - n0, self.ns, self.nd,
                               torch.get_num_threads())
            return w
        self.mod.dequant(self.bits, *self.args, w.data_ptr(), self.k, n0, n1, self.ns, self.nd,
                         torch.get_num_threads())
        return w

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        N, K = self.n, self.k
        rows = max(1, PANEL_BYTES // (4 * K))
        if N <= rows:
            return x @ self.dequantized(0, N).t()
        yt = torch.empty(N, x.shape[0], dtype=torch.float32)
        for n0 in range(0, N, rows):
            n1 = min(N, n0 + rows)
            torch.mm(self.dequantized(n0, n1), x.t(), out=yt[n0:n1])
        return yt.t().contiguous()


class Scratch:
    """One float32 buffer, grown as asked: the dequantized panels of a process's products (one
    device thread uses it, a product at a time)."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.float32)

    def take(self, numel: int) -> torch.Tensor:
        if self.buf.numel() < numel:
            self.buf = torch.empty(numel, dtype=torch.float32)
        return self.buf[:numel]


class CpuKernels:
    """One level's module behind the tensor interface the model, the runner and the tests call."""

    def __init__(self, mod: Any, activations: str = "float32") -> None:
        self.mod = mod
        self.isa: str = mod.ISA
        self.activations = activations  # int16, int8: packed products quantize x per group of 32
        self.int8_rows = activations == "int8"
        _check(not self.int8_rows or bool(mod.INT8_ROWS), f"the {self.isa} kernels have no int8 products")
        _check(activations != "int16" or bool(mod.INT16_BLOCKS), f"the {self.isa} kernels have no int16 products")
        self.scratch = Scratch()

    def packed(self, bits: int, u, s, m, d, dm) -> PackedKernel:
        return PackedKernel(self.mod, bits, u, s, m, d, dm, self.activations, self.scratch)

    def q4_linear(self, x, u, s, m, d, dm) -> torch.Tensor:
        return self.packed(4, u, s, m, d, dm)(x)

    def q8_linear(self, x, u, s, m, d, dm) -> torch.Tensor:
        return self.packed(8, u, s, m, d, dm)(x)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        _f32(x, "x")
        _check(x.dim() == 2 and x.stride(1) == 1 and w.is_contiguous() and w.dtype == torch.float32
               and w.numel() == x.shape[1], "x [T, H], w [H]")
        T, H = x.shape
        out = torch.empty(T, H, dtype=torch.float32)
        self.mod.rms_norm(x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), T, H, float(eps),
                          torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        _f32(x, "x")
        _f32(residual, "residual")
        _check(x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape
               and w.is_contiguous() and w.dtype == torch.float32 and w.numel() == x.shape[1],
               "x and residual [T, H] contiguous, w [H]")
        T, H = x.shape
        out = torch.empty(T, H, dtype=torch.float32)
        self.mod.add_rms_norm(x.data_ptr(), residual.data_ptr(), w.data_ptr(), out.data_ptr(), T, H, float(eps),
                              torch.get_num_threads())
        return out, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        _f32(gate_up, "gate_up")
        _check(gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0, "gate_up [T, 2I]")
        T, I = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(T, I, dtype=torch.float32)
        self.mod.silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), T, I, torch.get_num_threads())
        return out

    def rope_store(self, qkv: torch.Tensor, n_q: int, n_kv: int, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor) -> None:
        for t, name in ((qkv, "qkv"), (k_cache, "k_cache"), (v_cache, "v_cache"), (cos, "cos"), (sin, "sin")):
            _f32(t, name)
        _check(qkv.dim() == 3 and qkv.stride(2) == 1 and qkv.stride(1) == qkv.shape[2]
               and qkv.shape[1] == n_q + 2 * n_kv, "qkv [T, n_q + 2 n_kv, hd], heads contiguous")
        T, hd = qkv.shape[0], qkv.shape[2]
        _check(hd % 2 == 0 and cos.is_contiguous() and sin.is_contiguous() and cos.dim() == 2 and cos.shape[1] == hd
               and sin.shape == cos.shape and positions.dtype == torch.int64 and index.dtype == torch.int64
               and positions.numel() == T and index.numel() == T and positions.is_contiguous()
               and index.is_contiguous(), "positions and index int64 [T], cos/sin [L, hd]")
        _check(k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-1] == hd
               and k_cache.shape[-2] == n_kv and v_cache.shape == k_cache.shape, "caches [..., n_kv, hd] contiguous")
        norm = q_norm is not None and k_norm is not None
        if norm:
            for t, name in ((q_norm, "q_norm"), (k_norm, "k_norm")):
                _f32(t, name)
                _check(t.is_contiguous() and t.numel() == hd, f"{name} [hd]")
        self.mod.rope_store(qkv.data_ptr(), T, qkv.stride(0), n_q, n_kv, hd, positions.data_ptr(), cos.data_ptr(),
                            sin.data_ptr(), cos.shape[0], q_norm.data_ptr() if norm else 0,
                            k_norm.data_ptr() if norm else 0, float(eps), k_cache.data_ptr(), v_cache.data_ptr(),
                            k_cache.numel() // (n_kv * hd), index.data_ptr(), torch.get_num_threads())

    def paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     slots: torch.Tensor, ctx: torch.Tensor, kv_of_q: torch.Tensor, scale: float) -> torch.Tensor:
        _f32(q, "q")
        _check(q.dim() == 3 and q.stride(2) == 1, "q [B, n_q, hd]")
        _check(k_cache.dim() == 4 and k_cache.is_contiguous() and v_cache.is_contiguous()
               and v_cache.shape == k_cache.shape and k_cache.dtype == torch.float32
               and v_cache.dtype == torch.float32, "caches [blocks, block_size, n_kv, hd] float32 contiguous")
        _check(tables.dtype == torch.int32 and tables.is_contiguous() and tables.dim() == 2,
               "tables int32 [rows, max_blocks]")
        _check(slots.dtype == torch.int64 and ctx.dtype == torch.int64 and kv_of_q.dtype == torch.int32
               and slots.is_contiguous() and ctx.is_contiguous() and kv_of_q.is_contiguous(),
               "slots, ctx int64 [B], kv_of_q int32 [n_q]")
        B, n_q, hd = q.shape
        blocks, bs, n_kv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
        _check(k_cache.shape[3] == hd and kv_of_q.numel() == n_q and slots.numel() == B and ctx.numel() == B,
               "shapes do not match")
        out = torch.empty(B, n_q, hd, dtype=torch.float32)
        self.mod.paged_decode(q.data_ptr(), B, n_q, hd, q.stride(0), q.stride(1), k_cache.data_ptr(),
                              v_cache.data_ptr(), blocks, bs, n_kv, tables.data_ptr(), tables.shape[0], tables.shape[1],
                              slots.data_ptr(), ctx.data_ptr(), kv_of_q.data_ptr(), float(scale), out.data_ptr(),
                              torch.get_num_threads())
        return out


def load_level(name: str, activations: str | None = None) -> CpuKernels:
    """The kernels of level ``name`` (for tests of every level the machine runs), their products
    taking x as ``activations`` says (by default, as ``isa.activations`` chooses)."""
    level = next(lv for lv in isa.LEVELS if lv.name == name)
    try:
        return CpuKernels(importlib.import_module(f"neuron.kernels.{isa.module_name(name)}"),
                          activations or isa.activations(level))
    except ImportError as exc:
        raise KernelUnavailable(f"the {name} CPU kernels are not built ({exc}): reinstall neuron "
                                f"(./scripts/setup) with a C++ compiler") from None


def cpu_kernels() -> CpuKernels:
    """The kernels of the level this CPU runs, or KernelUnavailable (looked up once)."""
    result = _chosen()
    if isinstance(result, Exception):
        raise result
    return result


def choose_again() -> None:
    """Forget the choice ``cpu_kernels`` made, so that the next call reads NEURON_CPU_ISA and
    NEURON_CPU_ACTIVATIONS again (a process that changes them)."""
    _chosen.cache_clear()


@functools.cache
def _chosen() -> CpuKernels | Exception:
    try:
        level = isa.choose()
        isa.activations(level)
    except isa.IsaError as exc:
        return exc
    try:
        kernels = load_level(level.name)
    except KernelUnavailable as exc:
        return exc
    log.info("CPU kernels: %s (%d float32 lanes, %s activations)", kernels.isa, kernels.mod.LANES,
             kernels.activations)
    return kernels
