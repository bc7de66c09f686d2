"""The model's small ops fused: Triton kernels on CUDA, C++ on the CPU, with the torch reference
as the fallback for shapes and dtypes a kernel does not take."""

from __future__ import annotations

import logging

import torch

from neuron.models.ops import StateSpans, TorchOps

log = logging.getLogger("neuron.runner")


class TritonOps(TorchOps):
    """``int8_rows``: the model's projections are packed, so the norms and SiLU·mul also write
    their outputs' int8 form for the decode kernel (a few rows: ``kernels.packed.GEMV_ROWS``),
    which saves it a launch to quantize them."""

    def __init__(self, fallback: TorchOps, int8_rows: bool = False) -> None:
        from neuron.kernels import gpu as kernels  # Triton: only where a GPU runs them

        from neuron.kernels.gpu import GEMV_ROWS

        self.fallback, self.kernels = fallback, kernels
        self.int8_rows = GEMV_ROWS if int8_rows else 0  # the most rows written in int8 too

    def _quantize(self, x: torch.Tensor, n: int) -> bool:
        return x.shape[0] <= self.int8_rows and n % 32 == 0

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1:
            return self.fallback.rms_norm(x, weight, eps)
        return self.kernels.rms_norm(x, weight, eps, quantize=self._quantize(x, x.shape[1]))[0]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new residual stream into ``residual`` (the model owns it)."""
        if x.dim() != 2 or x.stride(1) != 1 or residual.stride() != x.stride():
            return self.fallback.add_rms_norm(x, residual, weight, eps)
        out, residual = self.kernels.rms_norm(x, weight, eps, residual, quantize=self._quantize(x, x.shape[1]))
        return out, residual

    def reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            comm, peers=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum over the ranks in the norm's kernel where the rows fit the peer buffer."""
        peers = peers if peers is not None else comm.peers
        if peers is None or not peers.takes(x, residual) or residual.shape != x.shape:
            return super().reduce_add_rms_norm(x, residual, weight, eps, comm)
        return self.kernels.rms_norm(x, weight, eps, residual, quantize=self._quantize(x, x.shape[1]), peers=peers)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(1) != 1:
            return self.fallback.silu_mul(gate_up)
        return self.kernels.silu_mul(gate_up, quantize=self._quantize(gate_up, gate_up.shape[1] // 2))

    def moe_route(self, logits: torch.Tensor, k: int, norm: bool, dtype: torch.dtype,
                  experts: int) -> tuple[torch.Tensor, ...]:
        """A sparse MoE block's router after its product: softmax, top-k and renormalising in one
        kernel, and a shared expert's gate after the ``experts`` (``kernels.moe.route``)."""
        return self.kernels.moe_route(logits, k, norm, dtype, experts)

    def sparse_moe(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, first: int,
                   gate_up: torch.Tensor, down: torch.Tensor,
                   shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """A sparse MoE block's experts in the grouped kernel (``kernels.moe``; dense experts), and
        a ``shared`` expert's gate/up and down weights where it runs with them."""
        return self.kernels.sparse_moe(x, weights, chosen, first, gate_up, down, self.silu_mul, shared)

    def causal_conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                    spans: StateSpans) -> torch.Tensor:
        if spans.conv_snaps is not None:
            self.kernels.conv_snapshots(x, state, spans.conv_snaps)
        return self.kernels.causal_conv(x, weight, bias, state, spans.table, spans.max_n)

    def delta_rule(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor,
                   dt_bias: torch.Tensor, state: torch.Tensor, spans: StateSpans, r: int) -> torch.Tensor:
        return self.kernels.delta_rule(qkv, a, b, neg_a, dt_bias, state, spans.table, spans.chunks, r)

    def gated_rms_norm(self, o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.gated_rms_norm(o, z, weight, eps)


class CpuOps(TorchOps):
    """The small ops as fused C++ (``csrc/cpu_ops.cpp``) for float32 on the CPU, with the torch
    reference for anything else."""

    def __init__(self, fallback: TorchOps, kernels) -> None:
        self.fallback, self.kernels = fallback, kernels

    @staticmethod
    def _takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype == weight.dtype == torch.float32 and x.stride(1) == 1

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._takes(x, weight):
            return self.fallback.rms_norm(x, weight, eps)
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new residual stream into ``residual`` (the model owns it)."""
        if not self._takes(x, weight) or not x.is_contiguous() or not residual.is_contiguous() \
                or residual.dtype != x.dtype:
            return self.fallback.add_rms_norm(x, residual, weight, eps)
        out, residual = self.kernels.add_rms_norm(x, residual, weight, eps)
        return out, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.dtype != torch.float32 or gate_up.stride(1) != 1:
            return self.fallback.silu_mul(gate_up)
        return self.kernels.silu_mul(gate_up)


def triton_fits(head_dim: int) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    half = head_dim // 2
    return head_dim >= 16 and head_dim % 2 == 0 and half & (half - 1) == 0


def cpu_kernels_or_none():
    """The C++ CPU ops, or None where they cannot be built (the torch ops run instead)."""
    from neuron.kernels.cpu import KernelUnavailable, cpu_kernels

    try:
        return cpu_kernels()
    except KernelUnavailable as exc:
        log.warning("%s; the CPU step runs unfused torch ops", exc)
        return None
