"""The packed matrix of a ``QuantWeight`` (``quant``): its integers packed (two 4-bit values a
byte, in GGUF's Q4_0/Q4_1 order) beside its scales, computed from by the CPU kernel
(``neuron/kernels/csrc/qlinear_cpu.cpp``, float32 activations and accumulation) or the Triton
ones on a GPU (``neuron/kernels/packed.py``)."""

from __future__ import annotations

import numpy as np
import torch

from .quant import GROUP, QuantWeight


def _tensor(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    return a if torch.is_tensor(a) else torch.from_numpy(np.ascontiguousarray(a))


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> [N, K/2]: per group of 32, byte j holds u[j] (low nibble) and
    u[j + 16] (high nibble), as GGUF's Q4_0/Q4_1 blocks do."""
    N, K = u.shape
    g = u.reshape(N, K // GROUP, 2, GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(N, K // 2).contiguous()


def _packed(q: QuantWeight, bits: int, device: torch.device) -> torch.Tensor:
    """``q``'s integers as the kernels read them, on ``device``: 4-bit ones two a byte."""
    if q.nibbles is not None and q.stored is None:
        return _tensor(q.nibbles).to(device)
    u = _tensor(q.u).to(device)
    return pack_nibbles(u) if bits == 4 else u.contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    T, half = packed.shape
    g = packed.reshape(T, half // 16, 16)
    return torch.cat([g & 15, g >> 4], dim=-1).reshape(T, 2 * half)


def host_tensors(q: QuantWeight) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q`` as the CPU kernels take it (``kernels.cpu.PackedKernel``), its rows as the file holds
    them: bits, u, and s, m float16 (d, dm empty), or, for the K-quants, exactly the integers and
    float16s the file builds its scales from: s, m int8 and d, dm float16."""
    q = q.on_host()
    bits = 4 if q.bits <= 4 else 8
    u = _packed(q, bits, torch.device("cpu"))
    if q.sup is not None:
        return (bits, u, torch.from_numpy(q.sup.sc.copy()), torch.from_numpy(q.sup.mn.copy()),
                torch.from_numpy(q.sup.d.copy()), torch.from_numpy(q.sup.dm.copy()))
    empty = torch.empty(0, 0, dtype=torch.float16)
    return (bits, u, torch.from_numpy(q.s).to(torch.float16).contiguous(),
            torch.from_numpy(q.m).to(torch.float16).contiguous(), empty, empty)


class PackedLinear:
    """``y = x W^T + b`` from ``W`` packed in groups of 32 (4-bit, or 8-bit for wider types),
    computed by the CPU kernel with float32 activations; other activation dtypes are converted at
    the kernel's edge."""

    def __init__(self, q: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        N, K = q.shape
        if K % GROUP:
            raise ValueError(f"a packed weight needs rows of whole {GROUP}-element groups, not {K}")
        self.n, self.k, self.source, self.group = N, K, q.source, q.group
        self.bits = 4 if q.bits <= 4 else 8
        self.bias, self.dtype = bias, dtype
        self.device = device or torch.device("cpu")
        self.perm = torch.from_numpy(q.perm).to(self.device) if q.perm is not None else None
        if self.device.type == "cuda":  # packed on the device; the Triton kernels take each group's
            # scale and offset side by side (pair_scales), in float16, or float32 for the K-quants (exact)
            from neuron.kernels.gpu import coarsen_scales, pair_scales, unpack_modes

            self.u = _packed(q, self.bits, self.device)
            scales = [_tensor(t).to(self.device) for t in (q.s, q.m)]
            if q.sup is None:
                scales = [t.to(torch.float16) for t in scales]
            self.sm = coarsen_scales(pair_scales(*scales))
            self.unpack = unpack_modes(self.sm, self.bits)  # by activation dtype: packed_gemm.weight_tile
            self.s, self.m = self.sm[..., 0], self.sm[..., 1]
            self.d = self.dm = torch.empty(0, 0, dtype=torch.float16, device=self.device)
            self._kernel = None
            self.configs: dict[int, tuple[int, ...]] = {}  # measured at load: runner/linear.py
            self.stacked = False  # u and sm: views of a stack of experts (models/moe.stack_packed)
            self._plain = False
            return
        from neuron.kernels.cpu import cpu_kernels

        self._kernel = cpu_kernels().packed(*host_tensors(q))
        self.u, self.s, self.m, self.d, self.dm = self._kernel.tensors  # in blocks of rows where it uses them so
        self._plain = self.perm is None and self.bias is None

    @property
    def out_features(self) -> int:
        return self.n

    def tensors(self) -> list[torch.Tensor]:
        scales = [self.sm] if self.device.type == "cuda" else [self.s, self.m]  # s, m: views of sm there
        extra = [t for t in (self.bias, self.perm) if t is not None]
        return [self.u, *scales, self.d, self.dm, *extra]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x W^T + b`` in ``x``'s dtype, or its values in ``out_dtype``."""
        if self._plain and x.ndim == 2 and out_dtype is None and x.dtype == torch.float32 and x.is_cpu:
            return self._kernel(x)  # a decode step's usual case: a few microseconds of views saved
        shape = x.shape
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if x.is_cuda:
            from neuron.kernels.gpu import qlinear

            y = qlinear(x.reshape(-1, self.k), self.u, self.sm, self.bits, getattr(x, "int8_rows", None),
                        self.configs, out_dtype, self.unpack.get(x.dtype, "float"))
            if self.bias is not None:
                y = y + self.bias
            return y.view(*shape[:-1], self.n)
        y = self._kernel(x.reshape(-1, self.k).float())
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        if out_dtype is not None:
            y = y.to(out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W, dequantized (the embedding lookup on a packed matrix)."""
        if ids.is_cuda:
            from neuron.kernels.gpu import dequantize

            return dequantize(self.u, self.sm, self.bits, self.dtype, ids=ids.reshape(-1)).view(*ids.shape, self.k)
        if self._kernel.blocked:
            return self._kernel.rows(ids.reshape(-1)).view(*ids.shape, self.k).to(self.dtype)
        u = self.u[ids]
        if self.bits == 4:
            u = unpack_nibbles(u)
        T = ids.shape[0]
        s, m = self.s[ids].float(), self.m[ids].float()
        if self.d.numel():
            per = s.shape[1] // self.d.shape[1]
            s = s * self.d[ids].float().repeat_interleave(per, dim=1)
            m = m * self.dm[ids].float().repeat_interleave(per, dim=1)
        w = u.view(T, -1, self.group).float() * s[..., None] + m[..., None]
        return w.view(T, self.k).to(self.dtype)
