"""The reference of x's int8 form per group of 32, torch only (no triton), for the tests of the
GPU decode kernel (int8_rows.py) and of the CPU's int8 products (csrc/qdot.h)."""

from __future__ import annotations

import torch


def reference_quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """What the decode kernel multiplies for ``x`` [M, K]: ``d * round(x / d)`` per group of 32
    (float32 torch ops); ``reference_qlinear`` of it is the decode kernel's product."""
    M, K = x.shape
    g = x.float().view(M, K // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    v = g * torch.where(amax > 0, 127.0 / amax, 0.0)
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # half away from zero, as the kernel rounds
    return (q * (amax / 127.0)).view(M, K)
