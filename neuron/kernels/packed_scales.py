"""The packed-weight kernels' scales: each group's scale and offset side by side (one load where
there were two), and kept per 128 (or 64) columns where a checkpoint's groups are that wide."""

from __future__ import annotations

import torch


def pair_scales(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The kernels' scales: ``s`` and ``m`` [N, K/32] (or [N, K/16]) side by side, [N, K/32, 2],
    in float16, or float32 (which keeps the K-quants' scales exact). A kernel reads the pair of a
    group as one word: one load where there were two."""
    dtype = torch.float16 if s.dtype == m.dtype == torch.float16 else torch.float32
    return torch.stack([s.to(dtype), m.to(dtype)], dim=-1).contiguous()


def coarsen_scales(sm: torch.Tensor) -> torch.Tensor:
    """``pair_scales``' pairs [N, K/32, 2] as one pair per 128 (or 64) columns where every row's
    pairs repeat that way (the AWQ and GPTQ releases' groups of 128, kept per 32 by the reader):
    a float32 pair is 8 bytes, a quarter bit a weight at 32 columns a pair."""
    if sm.shape[-1] != 2 or sm.shape[1] == 0:
        return sm
    for f in (4, 2):
        if sm.shape[1] % f == 0:
            runs = sm.reshape(sm.shape[0], -1, f, 2)
            if bool((runs == runs[:, :, :1]).all()):
                return runs[:, :, 0].contiguous()
    return sm


def scale_words(sm: torch.Tensor) -> torch.Tensor:
    """``pair_scales``' pairs as one word each, [N, NS]: int32 (two float16), int64 (two float32)."""
    assert sm.dtype in (torch.float16, torch.float32) and sm.shape[-1] == 2 and sm.is_contiguous()
    return sm.view(torch.int32 if sm.dtype == torch.float16 else torch.int64).view(sm.shape[:2])



def unpack_modes(sm: torch.Tensor, bits: int) -> dict[torch.dtype, str]:
    """How the tensor-core kernel unpacks W (scales ``sm``: ``pair_scales``' pairs) for each
    16-bit activation dtype so that each weight is the exact ``s q + m`` rounded once
    (``packed_gemm.weight_tile``): "fast" or "split" (the 4-bit unpacking in 16-bit FMAs, with an
    FMA more a pair of weights where a scale is not exact in the dtype: ``packed_gemm._asm``), or
    "float" where those cannot be exact: a 4-bit group whose ``m + c s`` (``group_operands``) the
    dtype does not hold (Q4_1's and Q4_K's arbitrary minimums), an 8-bit one in float16 whose
    scale or offset float16 does not hold; "float" unpacks in float32 instead, slower."""
    s, m = sm[..., 0].float(), sm[..., 1].float()
    if sm.dtype == torch.float32:  # the kernel takes c = the zero point, round(-m / s)
        safe = torch.where(s == 0, 1.0, s)
        c = torch.where(s == 0, 0.0, torch.clamp(torch.floor(-m / safe + 0.5), -112, 112))
        offsets = {dt: bool((m + c * s == 0).all()) for dt in (torch.bfloat16, torch.float16)}
    else:  # c = 8
        r = m + 8 * s
        offsets = {dt: torch.equal(r.to(dt).float(), r) for dt in (torch.bfloat16, torch.float16)}
    modes = {}
    for dt in (torch.bfloat16, torch.float16):
        scales = torch.equal(s.to(dt).float(), s)
        if bits == 8:  # bfloat16: scaled in float32 (exact); float16: s and m as float16s
            modes[dt] = "fast" if dt == torch.bfloat16 or (scales and torch.equal(m.to(dt).float(), m)) else "float"
        else:
            modes[dt] = "float" if not offsets[dt] else "fast" if scales else "split"
    return modes
