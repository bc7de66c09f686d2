"""The tensor-parallel linear: ``y = x W^T + b`` over this rank's share of a weight.

- ``column_parallel``: each rank holds a range of W's output rows (of each weight it stacks: fused
  q/k/v, gate/up) and computes those outputs of the whole input; no collective. The ranges need
  not be equal (3 KV heads over 2 ranks is 2+1). Its bias is sliced like its rows.
- ``row_parallel``: each rank holds a range of W's input columns and multiplies the matching share
  of the input (what a column-parallel layer before it left on the rank); the partial sums are
  added across ranks by the caller's all-reduce (``layers.Collectives``). Its bias is added by one
  rank only (the caller passes it on rank 0), so the sum counts it once. Packed weights split
  their input columns only on whole quant groups (``sharding``).

At world 1 both are the whole weight. Every projection of a model is one of these, so how a
weight is stored is decided here and nowhere else in the model code: packed quantized groups
(``packed_linear.PackedLinear``) when the source holds it quantized (a GGUF quant type, or in-situ
quantization) and a packed kernel runs on this device in this activation dtype; dense otherwise.
"""

from __future__ import annotations

import functools

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from .fp8 import Fp8Linear, Fp8Weight, concat_fp8
from .packed_linear import PackedLinear
from .quant import QuantWeight, concat_rows

log = logging.getLogger("neuron.linear")


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x W^T + b`` in ``x``'s dtype, or converted to ``out_dtype``."""
        y = F.linear(x, self.weight, self.bias)
        return y if out_dtype is None else y.to(out_dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W: the embedding lookup when this matrix is also the embedding."""
        return F.embedding(ids, self.weight)


class ConcatLinear:
    """Fused projections whose parts are packed differently (one 4-bit plane beside two): each
    part runs its own kernel and the outputs are concatenated."""

    def __init__(self, parts: list[PackedLinear]) -> None:
        self.parts = parts

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.tensors()]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.cat([p(x, out_dtype) for p in self.parts], dim=-1)


AnyLinear = Linear | PackedLinear | ConcatLinear | Fp8Linear


class Source(Protocol):
    def get(self, name: str, *, dim: int | None = None, part: range | None = None) -> torch.Tensor: ...


# Packed weights on a GPU (neuron/kernels/packed.py): 44% (q8_0) and 69% (q4) less memory than bf16 for
# an 8B model; batch-1 decode at 1.81-1.82x (q8_0) and 2.54x (q4) of bf16's speed on an H200
# (scripts/perf-gpu --quantize). False: dense weights on GPUs.
GPU_PACKED = True


def packed_kernel_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed weights run here: on the CPU, in any activation dtype (the kernels compute
    in float32), where the kernels build; on a GPU with ``GPU_PACKED`` (bf16/fp16 activations)."""
    if device.type == "cuda":
        return GPU_PACKED and dtype in (torch.bfloat16, torch.float16)
    if device.type != "cpu":
        return False
    from neuron.kernels.cpu import KernelUnavailable, cpu_kernels

    try:
        cpu_kernels()
    except KernelUnavailable as exc:
        _warn_once(f"{exc}; quantized weights are dequantized instead")
        return False
    return True


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)


def column_parallel(src: Source, parts: list[tuple[str, range | None]], *, dtype: torch.dtype,
                    device: torch.device, bias: torch.Tensor | None = None, rows_to: int | None = None) -> AnyLinear:
    """Output rows ``part`` of each named weight (None: all of them), stacked; ``rows_to``
    zero-pads the rows (a vocabulary shard padded to the common length)."""
    return _build(src, parts, 0, dtype, device, bias, rows_to)


def row_parallel(src: Source, parts: list[tuple[str, range | None]], *, dtype: torch.dtype, device: torch.device,
                 bias: torch.Tensor | None = None) -> AnyLinear:
    """Input columns ``part`` of each named weight; the caller all-reduces the outputs."""
    return _build(src, parts, 1, dtype, device, bias, None)


def _build(src: Source, parts: list[tuple[str, range | None]], dim: int, dtype: torch.dtype, device: torch.device,
           bias: torch.Tensor | None, rows_to: int | None) -> AnyLinear:
    get_fp8 = getattr(src, "get_fp8", None)
    if get_fp8 is not None:  # an FP8 checkpoint: unpacked in tiles on any device
        fp8 = [get_fp8(name, dim=dim, part=part) for name, part in parts]
        if all(f is not None for f in fp8):
            return _fp8(fp8, bias, dtype, device, rows_to)
        if any(f is not None for f in fp8):
            raise ValueError(f"{'+'.join(n for n, _ in parts)}: FP8 and float parts of one fused projection")
    get_quant = getattr(src, "get_quant", None)
    if get_quant is not None and packed_kernel_for(device, dtype):
        quants = [get_quant(name, dim=dim, part=part) for name, part in parts]
        if all(q is not None for q in quants):
            return _packed(quants, bias, dtype, device, rows_to)
        if any(q is not None for q in quants):
            log.warning("%s: quantized and float parts cannot share one packed matrix; stored dense",
                        "+".join(n for n, _ in parts))
    weight = torch.cat([src.get(name, dim=dim, part=part).to(device, dtype) for name, part in parts])
    if rows_to is not None and rows_to > weight.shape[0]:
        weight = torch.cat([weight, weight.new_zeros(rows_to - weight.shape[0], weight.shape[1])])
    return Linear(weight, bias)


def _packed(quants: list[QuantWeight], bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
            rows_to: int | None) -> PackedLinear | ConcatLinear:
    if rows_to is not None:
        rows = sum(q.shape[0] for q in quants)
        if rows_to > rows:
            quants = [*quants, _zero_rows(rows_to - rows, quants[0].shape[1], quants[-1].bits)]
    groups: list[list[QuantWeight]] = []
    for q in quants:  # consecutive parts of one plane count share a matrix
        if groups and (groups[-1][0].bits <= 4) == (q.bits <= 4):
            groups[-1].append(q)
        else:
            groups.append([q])
    if len(groups) == 1:
        return PackedLinear(concat_rows(groups[0]), bias, dtype, device)
    linears, start = [], 0
    for g in groups:
        q = concat_rows(g)
        part_bias = bias[start:start + q.shape[0]] if bias is not None else None
        linears.append(PackedLinear(q, part_bias, dtype, device))
        start += q.shape[0]
    return ConcatLinear(linears)


def _fp8(parts: list[Fp8Weight], bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
         rows_to: int | None) -> Fp8Linear:
    q = concat_fp8(parts)
    if rows_to is not None and rows_to > q.values.shape[0]:
        extra = rows_to - q.values.shape[0]
        q = Fp8Weight(torch.cat([q.values, q.values.new_zeros(extra, q.values.shape[1])]),
                      torch.cat([q.scale, q.scale.new_zeros(extra, q.scale.shape[1])]), q.col_block, q.source)
    return Fp8Linear(q, bias, dtype, device)


def _zero_rows(n: int, k: int, bits: int) -> QuantWeight:
    import numpy as np

    return QuantWeight(np.zeros((n, k), np.uint8), np.zeros((n, k // 32), np.float32),
                       np.zeros((n, k // 32), np.float32), bits, "")


def packed_parts(model) -> list[PackedLinear]:
    """The shard's packed matrices (a concatenated projection's parts one by one)."""
    return [part for part in model.linears()[0] if isinstance(part, PackedLinear)]


def has_packed(model) -> bool:
    return bool(packed_parts(model))


def describe_packing(model) -> str:
    """How a shard's projections are stored: "int4 from Q4_1 x210, int8 planes from Q8_0 x1"."""
    from collections import Counter

    parts, dense_experts = model.linears()
    seen: Counter[str] = Counter(f"dense {dtype} experts" for dtype in dense_experts)
    for part in parts:
        if isinstance(part, PackedLinear):
            seen[f"int{part.bits} from {part.source}"] += 1
        elif isinstance(part, Fp8Linear):
            seen[part.source + (", on FP8 tensor cores" if part.kernel else "")] += 1
        else:
            seen[f"dense {str(part.weight.dtype).removeprefix('torch.')}"] += 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(seen.items()))
