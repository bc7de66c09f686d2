"""FP8 weights kept as their checkpoint holds them: float8 values (one byte a weight) and their
scales, a scale per block of rows and columns (Qwen's and DeepSeek's FP8 releases), per row or
per tensor (compressed-tensors). Products run on the FP8 tensor cores where the GPU has them
(``Fp8Linear``); elsewhere the weight is unpacked to the activation dtype a tile of rows at a
time (float32 on the CPU), never whole. Either way inside CUDA graphs."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

TILE = 1 << 22  # weights unpacked at a time (16 MB of float32)


@dataclass
class Fp8Weight:
    """``w[n, k] = values[n, k] * scale[n, col_block[k]]`` for a share [N, K] of a weight."""

    values: torch.Tensor  # float8 [N, K]
    scale: torch.Tensor  # float32 [N, blocks of columns]
    col_block: torch.Tensor  # int64 [K]
    source: str  # "fp8 e4m3, blocks of 128x128", ...

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scale[:, self.col_block]


def quantize_fp8(w: torch.Tensor, columns: int = 32, device: torch.device | None = None) -> Fp8Weight:
    """In-situ FP8 (``quantize = "fp8"``): e4m3 values with a float32 scale per row and
    ``columns`` columns (``loader/insitu.fp8_columns``: 128 where they divide the matrix, so the
    products go to the FP8 tensor cores). ``device``: where to compute it (a rank's GPU; the
    values stay there)."""
    N, K = w.shape
    x = w.detach().to(device or "cpu").float().reshape(N, -1, columns)
    scale = x.abs().amax(-1) / torch.tensor(448.0, device=x.device)  # a true division on every device
    values = (x / torch.where(scale == 0, 1, scale)[..., None]).to(torch.float8_e4m3fn).reshape(N, K)
    return Fp8Weight(values, scale, torch.arange(K) // columns, f"fp8 e4m3, blocks of 1x{columns} (in situ)")


def concat_fp8(parts: list[Fp8Weight]) -> Fp8Weight:
    """Weights stacked by rows (fused q/k/v, gate/up), which share their column blocks."""
    first = parts[0]
    if any(not torch.equal(p.col_block, first.col_block) or p.values.dtype != first.values.dtype for p in parts):
        raise ValueError("fused FP8 weights must share their column blocks and float8 type")
    sources = sorted({p.source for p in parts})
    return Fp8Weight(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), first.col_block,
                     "+".join(sources))


def tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` multiplies e4m3 on its tensor cores (CUDA compute capability 8.9 and
    later: Ada, Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear:
    """Where the device has FP8 tensor cores and the weight's column groups are whole and
    uniform, products run there (``kernels/fp8``): the rows of ``x`` quantized to e4m3 on the
    fly, per token and group of up to 128 columns, as transformers and vLLM run these checkpoints
    on such GPUs. Elsewhere (the CPU, older GPUs, a share that starts inside a column block) the
    weight is unpacked to the activation dtype a tile of rows at a time and ``x`` stays as it is,
    as transformers does there."""

    def __init__(self, q: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        self.values = q.values.to(device)
        self.scale_t = q.scale.to(device, torch.float32).t().contiguous()  # [column groups, N]: a step reads a row
        self.scale = self.scale_t.t()
        self.col_block = q.col_block.to(device)
        self.n, self.k = q.values.shape
        self.source, self.bias, self.dtype = q.source, bias, dtype
        self.compute = torch.float32 if device.type == "cpu" else dtype
        self.tile = max(1, TILE // max(1, self.k))
        self.kernel: tuple[int, int] | None = None  # (column group, activation group) on FP8 tensor cores
        self.blocks: torch.Tensor | None = None  # [N / 128, K / 128] scales, for torch's block-scaled product
        self.fused_config: tuple[int, int, int, int, int] | None = None  # measured at load (runner/linear.tune_fp8)
        if tensor_cores(device) and self.values.dtype == torch.float8_e4m3fn:
            from neuron.kernels.fp8 import activation_group, blockwise_ok

            width = int((q.col_block == 0).sum())
            block_k = activation_group(self.k, width)
            if block_k and torch.equal(q.col_block, torch.arange(self.k) // width):
                self.kernel = (width, block_k)
                per_block = self.scale_t[:, ::128]  # a 128x128 block's scale, where W's rows come in such blocks
                if (width == 128 and torch.equal(per_block.repeat_interleave(128, 1)[:, :self.n], self.scale_t)
                        and blockwise_ok(device)):  # probed at load, not first inside a graph capture
                    self.blocks = self._cublas_takes(per_block.t().contiguous(), dtype, device)

    def _cublas_takes(self, blocks: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """``blocks`` where cuBLAS multiplies this weight's shape (one product of a few rows at
        load), else None: its prompts then go to the Triton product, not to a failed step each."""
        from neuron.kernels.fp8 import FUSED_ROWS, scaled_mm_blocks

        try:
            scaled_mm_blocks(torch.zeros(FUSED_ROWS + 1, self.k, device=device, dtype=dtype), self.values, blocks,
                             torch.bfloat16)
        except (RuntimeError, ValueError) as e:
            log.info("FP8 %dx%d: prompts by Triton, cuBLAS said %s", self.n, self.k, e)
            return None
        return blocks

    @property
    def out_features(self) -> int:
        return self.n

    def tensors(self) -> list[torch.Tensor]:
        return [self.values, self.scale_t, self.col_block, *([self.blocks] if self.blocks is not None else []),
                *([self.bias] if self.bias is not None else [])]

    def _weights(self, rows: slice | torch.Tensor) -> torch.Tensor:
        return (self.values[rows].to(torch.float32) * self.scale[rows][:, self.col_block]).to(self.compute)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        shape = x.shape
        if self.kernel is not None:
            from neuron.kernels.fp8 import fp8_linear

            y = fp8_linear(x.reshape(-1, self.k), self.values, self.scale_t, *self.kernel,
                           out_dtype=out_dtype if self.bias is None else torch.float32, blocks=self.blocks,
                           config=self.fused_config)
            if self.bias is not None:
                y = (y + self.bias).to(out_dtype or x.dtype)
            return y.view(*shape[:-1], self.n)
        flat = x.reshape(-1, self.k).to(self.compute)
        if self.tile >= self.n:
            y = F.linear(flat, self._weights(slice(None)))
        else:
            y = torch.cat([F.linear(flat, self._weights(slice(r, r + self.tile))) for r in range(0, self.n, self.tile)],
                          dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.to(out_dtype or x.dtype).view(*shape[:-1], self.n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W, unpacked (an embedding lookup on this matrix)."""
        flat = ids.reshape(-1)
        return self._weights(flat).to(self.dtype).view(*ids.shape, self.k)
