"""The 4-bit packed product on the tensor cores, in CUDA C++ (``cuda/w4mma.cu``, compiled by
NVRTC: ``nvrtc.py``): ``y = x W^T`` with W in ``packed_linear.PackedLinear``'s own layout, each
weight the exact ``s q + m`` rounded once to x's dtype (the "fast" and "split" unpackings of
``packed_scales.unpack_modes``), for 1 to ``MMA_ROWS`` rows of x a launch.

Triton's tensor-core product (``packed_gemm``) stays for what this one does not take: 8-bit W,
the K-quants' half-group scales, the "float" unpacking, K not a multiple of 128, float32 x, and
hosts where NVRTC does not load."""

from __future__ import annotations

import ctypes

import torch

from . import nvrtc
from .launch import multiprocessors
from .packed_gemm import LOCKS, split_counters

MMA_ROWS = 16  # rows of x a launch takes (8 a tile of the MMA's narrow side, up to 2 tiles)
# (tiles of 16 rows of W a warp, tiles of 8 rows of x, chunks of 128 columns in flight, warps a
# block, blocks a multiprocessor the registers are sized for) by the rows of x rounded up, and the
# shapes the load-time tuner tries
MMA_CONFIG = {8: (2, 1, 2, 4, 3), 16: (2, 2, 2, 4, 3)}
MMA_SHAPES = ((2, 1, 2, 4, 3), (2, 1, 2, 4, 4), (2, 1, 3, 4, 3), (2, 2, 2, 4, 3), (1, 2, 3, 4, 2))
BLOCKS_PER_SM = 4  # how many blocks a multiprocessor the split of K aims at
# rows of x that take this product where no tuned config says otherwise: up to 8 rows the int8
# decode kernel stays the default (the load-time tuner picks this one there where it is faster)
MMA_DEFAULT_ROWS = range(9, MMA_ROWS + 1)


def supported(x: torch.Tensor, bits: int, K: int, NS: int, unpack: str) -> bool:
    gs = K // NS if NS else 0
    return (bits == 4 and unpack in ("fast", "split") and x.dtype in (torch.bfloat16, torch.float16)
            and x.is_cuda and K % 128 == 0 and gs in (32, 64, 128) and nvrtc.available())


def config_for(M: int) -> tuple[int, ...]:
    return MMA_CONFIG[next(rows for rows in sorted(MMA_CONFIG) if rows >= min(M, MMA_ROWS))]


def candidates(rows: int) -> list[tuple]:
    """The load-time tuner's configs for ``rows`` rows of x: ``("mma", *config)``, each of
    ``MMA_SHAPES`` whose tile of x holds the rows without doubling them, with the default split of
    K and with fixed ones."""
    out = []
    for config in MMA_SHAPES:
        if rows <= MMA_ROWS and 8 * config[1] >= rows and 8 * config[1] <= 2 * max(rows, 8):
            out += [("mma", *config), *(("mma", *config, split) for split in (1, 4, 16))]
    return out


def split_for(blocks: int, chunks: int, device: torch.device) -> int:
    """Parts of K: doubled while the blocks number fewer than ``BLOCKS_PER_SM`` a multiprocessor
    and each part keeps four or more chunks of 128 columns."""
    split, want = 1, BLOCKS_PER_SM * multiprocessors(device)
    while blocks * split < want and chunks >= 8 * split:
        split *= 2
    return split


def qmma(x: torch.Tensor, u: torch.Tensor, words: torch.Tensor, y: torch.Tensor, unpack: str,
         config: tuple[int, ...] | None = None) -> torch.Tensor:
    """``y`` [M, N] (x's dtype or float32) = ``x`` [M, K] times the 4-bit W (``u`` [N, K/2],
    ``words``: ``scale_words``' [N, NS]) transposed. ``config``: (tiles of W a warp, tiles of x,
    chunks in flight, warps a block, blocks a multiprocessor[, parts of K]), else ``config_for(M)``'s
    and ``split_for``'s."""
    M, K = x.shape
    N, NS = u.shape[0], words.shape[1]
    assert y.shape == (M, N) and y.dtype in (x.dtype, torch.float32) and x.stride(1) == 1 and y.is_contiguous()
    step = 8 * config[1] if config else MMA_ROWS
    for at in range(0, M, step):
        rows = min(step, M - at)
        _launch(x[at:at + rows], u, words, y[at:at + rows], unpack, config or config_for(rows), K, N, NS)
    return y


def _launch(x, u, words, y, unpack, config, K, N, NS) -> None:
    tiles_w, tiles_x, depth, warps, per_sm = config[:5]
    M = x.shape[0]
    assert M <= 8 * tiles_x
    blocks = -(-N // (16 * tiles_w * warps))
    chunks = K // 128
    split = config[5] if len(config) > 5 else split_for(blocks, chunks, x.device)
    per = -(-chunks // min(split, chunks))
    split = -(-chunks // per)
    assert split == 1 or blocks <= LOCKS, (blocks, LOCKS)
    part = torch.empty((split, M, N), device=x.device, dtype=torch.float32) if split > 1 else y
    f16 = "true" if x.dtype == torch.float16 else "false"
    wide = "true" if words.dtype == torch.int64 else "false"
    name = f"w4mma<{tiles_w}, {tiles_x}, {depth}, {warps}, {per_sm}, {f16}, {'true' if unpack == 'split' else 'false'}, {wide}>"
    kernel = nvrtc.kernel("w4mma.cu", name, x.device)
    gshift = (K // NS // 32).bit_length() - 1
    i32, i64 = ctypes.c_int, ctypes.c_long
    kernel((blocks, split, 1), 32 * warps,
           [u, i64(u.stride(0)), words, i32(NS), i32(gshift), x, i64(x.stride(0)),
            y, i32(y.dtype == torch.float32), part, split_counters(x.device), i32(M), i32(N), i32(K), i32(per)],
           torch.cuda.current_stream(x.device).cuda_stream)
