"""Checkpoints quantized by their publisher, read in their own layout and kept packed: AWQ (GEMM)
and GPTQ (v1) projections become ``QuantWeight``s of the packed kernels, each rank reading only
the packed words of its share; FP8 ones ``Fp8Weight``s (neuron/models/fp8.py).

- AWQ, per linear ``X``: ``X.qweight`` int32 [K, N/8] (8 four-bit values a word along the output
  dimension, in AutoAWQ's order: value ``8j + AWQ_ORDER[i]`` in bits 4i..4i+3 of word j),
  ``X.qzeros`` int32 [K/g, N/8] (the same), ``X.scales`` float16 [K/g, N];
  ``w[n, k] = s[k // g, n] * (q[k, n] - z[k // g, n])``.
- GPTQ: ``X.qweight`` int32 [K * bits / 32, N] (values along the input dimension, lowest bits
  first), ``X.qzeros`` int32 [K/g, N * bits / 32] (along the output dimension) holding each zero
  point less one (the v1 convention), ``X.scales`` float16 [K/g, N], ``X.g_idx`` [K] (each input
  column's group). With ``desc_act`` a group's columns lie anywhere: a share's columns are sorted
  by group and the input is read in that order (``QuantWeight.perm``), which needs each group's
  columns in the share to come in whole runs of 32 (always so for a whole row of the matrix).

- FP8: ``X.weight`` float8 [N, K] with ``X.weight_scale_inv`` [ceil(N / bn), ceil(K / bk)] (a
  scale per block, multiplied in despite its name) or ``X.weight_scale`` (per tensor, or [N] /
  [N, 1] per row); ``w = values * scale``.

The zero points stay exact: a group's offset ``-s z`` is the float16 scale times a small integer
(the super-block form of the K-quants, ``m = dm * mn``), which the packed kernels multiply out in
float32 (an offset rounded to float16 changes greedy tokens of small models).
"""

from __future__ import annotations

import numpy as np
import torch

from neuron.models.fp8 import Fp8Weight
from neuron.models.quant import GROUP, QuantWeight, SuperScales
from protocol import CheckpointQuant

from neuron.errors import LoadError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, W] -> uint8 [R, 8 W] in column order."""
    shifts = 4 * torch.arange(8, dtype=torch.int32, device=words.device)
    nibbles = (words[..., None] >> shifts) & 15  # [R, W, 8]: nibble i
    out = torch.empty_like(nibbles)
    out[..., list(AWQ_ORDER)] = nibbles
    return out.reshape(words.shape[0], -1).to(torch.uint8)


def unpack_along_columns(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, W] -> uint8 [R, W * 32 / bits], lowest bits first (GPTQ's qzeros)."""
    per = 32 // bits
    shifts = bits * torch.arange(per, dtype=torch.int32, device=words.device)
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(words.shape[0], -1).to(torch.uint8)


def unpack_along_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [W, N] -> uint8 [W * 32 / bits, N], lowest bits first (GPTQ's qweight)."""
    per = 32 // bits
    shifts = bits * torch.arange(per, dtype=torch.int32, device=words.device)
    values = (words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(-1, words.shape[1]).to(torch.uint8)


class PublishedSource:
    """A safetensors source whose projections the publisher quantized: ``get_quant`` gives a
    rank's share packed, ``get`` its floats (for devices without the packed kernels). ``device``:
    where the packed integers are unpacked and kept (the rank's GPU; None: the host)."""

    def __init__(self, src, quant: CheckpointQuant, device: torch.device | None = None) -> None:
        self.src, self.q, self.device = src, quant, device
        self.quantized = True

    def _packed(self, name: str) -> str | None:
        base = name.removesuffix(".weight")
        return base if name.endswith(".weight") and self.src.has(base + ".qweight") else None

    def has(self, name: str) -> bool:
        return self._packed(name) is not None or self.src.has(name)

    def get(self, name: str, *, dim: int | None = None, part: range | None = None) -> torch.Tensor:
        f = self.get_fp8(name, dim=dim, part=part)
        if f is not None:
            return f.dequantize()
        q = self.get_quant(name, dim=dim, part=part)
        if q is not None:
            return torch.from_numpy(q.dequantize())
        t = self.src.get(name, dim=dim, part=part)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # never multiplied without its scale
            raise LoadError(f"{name} is float8 but has no {name}_scale_inv or {name}_scale beside it")
        return t

    def _fp8_scale(self, name: str) -> str | None:
        if self.q.method != "fp8" or not name.endswith(".weight"):
            return None
        return next((name + s for s in ("_scale_inv", "_scale") if self.src.has(name + s)), None)

    def get_fp8(self, name: str, *, dim: int | None = None, part: range | None = None) -> Fp8Weight | None:
        """An FP8 weight's share (rows with dim 0, columns with dim 1), as the file holds it."""
        scale_name = self._fp8_scale(name)
        if scale_name is None:
            return None
        values = self.src.get(name, dim=dim, part=part) if part is not None else self.src.get(name)
        if values.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or values.ndim != 2:
            raise LoadError(f"{name}: an FP8 weight with a scale must be a float8 matrix, not {values.dtype}")
        N, K = self._shape(name)
        rows = torch.arange(part.start, part.stop) if dim == 0 and part is not None else torch.arange(N)
        cols = torch.arange(part.start, part.stop) if dim == 1 and part is not None else torch.arange(K)
        scale = self.src.get(scale_name).float()
        if self.q.block:
            bn, bk = self.q.block
            if tuple(scale.shape) != (-(-N // bn), -(-K // bk)):
                raise LoadError(f"{scale_name}: {tuple(scale.shape)} scales for a {N}x{K} weight in {bn}x{bk} blocks")
            blocks = cols // bk
            scale, col_block = scale[rows // bn][:, int(blocks[0]):int(blocks[-1]) + 1], blocks - blocks[0]
            layout = f"blocks of {bn}x{bk}"
        elif scale.numel() == 1:
            scale, col_block, layout = scale.reshape(1, 1).expand(len(rows), 1), torch.zeros_like(cols), "per tensor"
        elif scale.numel() == N:
            scale, col_block, layout = scale.reshape(N, 1)[rows], torch.zeros_like(cols), "per row"
        else:
            raise LoadError(f"{scale_name}: {tuple(scale.shape)} scales fit neither the tensor nor its {N} rows")
        kind = str(values.dtype).removeprefix("torch.float8_").removesuffix("fn")
        return Fp8Weight(values, scale.contiguous(), col_block, f"fp8 {kind}, {layout}")

    def get_quant(self, name: str, *, dim: int | None = None, part: range | None = None) -> QuantWeight | None:
        base = self._packed(name)
        if base is None:
            return None
        rows = part if dim == 0 else None
        cols = part if dim == 1 else None
        if cols is not None and (cols.start % GROUP or cols.stop % GROUP):
            raise LoadError(f"{base}: a share of columns {cols.start}..{cols.stop} splits a {GROUP}-column group")
        q, z, s, col_group, perm = (self._awq if self.q.method == "awq" else self._gptq)(base, rows, cols)
        weight = _quant_weight(q, z, s, col_group, self.q, base)
        weight.perm = perm
        return weight

    # -- the layouts: q [K', N'] values, z [G', N'] zero points, s [G', N'] scales, and the group of
    # each column of the share (an index into the G' rows)

    def _groups(self, base: str, K: int, cols: range | None) -> tuple[range | None, np.ndarray]:
        g = self.q.group_size if self.q.group_size > 0 else K
        k = np.arange(cols.start, cols.stop) if cols is not None else np.arange(K)
        first = int(k[0]) // g if len(k) else 0
        groups = range(first, -(-int(k[-1] + 1) // g)) if cols is not None and len(k) else None
        return groups, k // g - first

    def _words(self, name: str, dim: int, values: range | None, per: int) -> tuple[torch.Tensor, int]:
        """The packed words holding ``values`` along ``dim`` (``per`` a word), and the offset of
        the first value in them."""
        if values is None:
            return self.src.get(name), 0
        first = values.start // per
        return self.src.get(name, dim=dim, part=range(first, -(-values.stop // per))), values.start - first * per

    def _awq(self, base: str, rows: range | None, cols: range | None):
        K = self._shape(base + ".qweight")[0]
        groups, col_group = self._groups(base, K, cols)
        words, skip = self._words(base + ".qweight", 1, rows, 8)
        if cols is not None:
            words = words[cols.start:cols.stop]
        q = _trim(unpack_awq(self._up(words)), skip, rows)
        zwords, zskip = self._words(base + ".qzeros", 1, rows, 8)
        z = _trim(unpack_awq(self._take(zwords, groups)), zskip, rows)
        s = self.src.get(base + ".scales", dim=1, part=rows) if rows is not None else self.src.get(base + ".scales")
        return q, z, self._take(s, groups), col_group, None

    def _gptq(self, base: str, rows: range | None, cols: range | None):
        bits, per = self.q.bits, 32 // self.q.bits
        K = self._shape(base + ".qweight")[0] * per
        groups, col_group = self._groups(base, K, cols)
        perm = None
        if self.src.has(base + ".g_idx"):
            g_idx = self.src.get(base + ".g_idx").numpy().astype(np.int64)
            g = self.q.group_size if self.q.group_size > 0 else K
            if not np.array_equal(g_idx, np.arange(len(g_idx)) // g):  # desc_act: groups out of column order
                share = g_idx[cols.start:cols.stop] if cols is not None else g_idx
                perm = np.argsort(share, kind="stable")
                groups, col_group = None, share[perm]
                if (col_group.reshape(-1, GROUP) != col_group[::GROUP, None]).any():
                    raise LoadError(f"{base}: its desc_act groups do not fall on whole {GROUP}-column runs of this "
                                    f"rank's share of columns; load it with fewer tensor-parallel ranks")
        words, skip = self._words(base + ".qweight", 0, cols, per)
        if rows is not None:
            words = words[:, rows.start:rows.stop]
        q = unpack_along_rows(self._up(words), bits)
        if cols is not None:
            q = q[skip:skip + len(cols)]
        zwords, zskip = self._words(base + ".qzeros", 1, rows, per)
        z = _trim(unpack_along_columns(self._take(zwords, groups), bits), zskip, rows).to(torch.int16) + 1
        s = self.src.get(base + ".scales", dim=1, part=rows) if rows is not None else self.src.get(base + ".scales")
        if perm is not None:
            q = q[torch.from_numpy(perm).to(q.device)]
        return q, z, self._take(s, groups), col_group, perm

    def _up(self, words: torch.Tensor) -> torch.Tensor:
        return words.to(self.device) if self.device is not None else words

    def _take(self, t: torch.Tensor, groups: range | None) -> torch.Tensor:
        return t if groups is None else t[groups.start:groups.stop]

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.src.shape(name)) if hasattr(self.src, "shape") else tuple(self.src.get(name).shape)


def _trim(values: torch.Tensor, skip: int, rows: range | None) -> torch.Tensor:
    return values if rows is None else values[:, skip:skip + len(rows)]


def _quant_weight(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, col_group: np.ndarray, quant: CheckpointQuant,
                  base: str) -> QuantWeight:
    """A share [K', N'] as a QuantWeight [N', K'] of 32-column groups: ``s`` the float16 scale of
    each one's group, ``m = -s z`` as ``dm * mn`` with ``dm = -s f`` (f a power of two that brings
    z into int8)."""
    K, N = q.shape
    sub = torch.from_numpy(col_group[::GROUP].copy())  # the group of each 32 columns
    scale = s.to(torch.float16)[sub].T.contiguous()  # [N, K / 32]
    zero = z.to(torch.int32)[sub].T.contiguous()
    factor = torch.ones_like(zero)
    while bool((big := (zero > 127 * factor)).any()):
        if bool((big & (zero % (2 * factor) != 0)).any()):
            raise LoadError(f"{base}: a zero point above 127 that is odd cannot be kept exact")
        factor = torch.where(big, 2 * factor, factor)
    d = scale.numpy()
    dm = (-(scale.float() * factor)).to(torch.float16).numpy()
    mn = (zero // factor).to(torch.int8).numpy()
    sup = SuperScales(np.ones(mn.shape, np.int8), mn, d, dm)
    s32 = d.astype(np.float32)
    m32 = dm.astype(np.float32) * mn.astype(np.float32)
    source = f"{quant.method.upper()} int{quant.bits} g{quant.group_size}"
    u = q.T.contiguous()  # on the device that unpacked it, or a numpy array on the host
    return QuantWeight(u if u.is_cuda else u.numpy(), s32, m32, quant.bits, source, GROUP, sup)
