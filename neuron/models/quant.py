"""Quantized weights kept packed: GGUF blocks and in-situ quantization, computed from by the CPU
kernels in ``csrc/qlinear_cpu.cpp`` (float32 activations and accumulation).

Every quantized weight is decoded to ``QuantWeight``: unsigned integers ``u`` with a scale and
an offset per group of 32 along the input dimension (16 for the K-quants with 16-element
sub-blocks), ``w = s * u + m``, exactly what the file holds, then stored as 4-bit ``u`` (Q4_0,
Q4_1, Q4_K, in-situ q4: 5 bits a weight with the float16 scale and offset; Q2_K, Q3_K: 6 bits)
or 8-bit ``u`` (Q8_0, Q5_0, Q5_1, Q5_K, in-situ q8_0: 9 bits a weight; Q6_K: 10 bits).

Exact: the same integers and the file's float16 scales (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, in situ).
K-quant sub-block scales (a float16 times a 6-bit integer) are rounded to float16 (2^-12 of the
scale). Other types (IQ*, TQ*) are requantized to symmetric 8 bits per group of 32, and their
source says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K, dequantize

log = logging.getLogger("neuron.quant")

GROUP = 32
SCHEMES = ("q8_0", "q4", "fp8")  # in-situ quantization (fp8: neuron/models/fp8.py)


@dataclass
class SuperScales:
    """The K-quants' scales as their files build them: ``s = d * sc``, ``m = dm * mn`` with a
    small integer per scale group and a float16 per super-block (exact in float32)."""

    sc: np.ndarray  # int8 [N, ns]
    mn: np.ndarray  # int8 [N, ns]
    d: np.ndarray  # float16 [N, nd], nd divides ns
    dm: np.ndarray  # float16 [N, nd]

    @property
    def per(self) -> int:
        return self.sc.shape[1] // self.d.shape[1]

    def take(self, rows) -> SuperScales:
        return SuperScales(self.sc[rows], self.mn[rows], self.d[rows], self.dm[rows])

    def scale_groups(self, g: range) -> SuperScales:
        per = self.per
        if g.start % per == 0 and (g.stop % per == 0 or g.stop == self.sc.shape[1]):
            blocks = slice(g.start // per, -(-g.stop // per))
            return SuperScales(self.sc[:, g.start:g.stop], self.mn[:, g.start:g.stop], self.d[:, blocks],
                               self.dm[:, blocks])
        return self.expanded(per).scale_groups(g)

    def expanded(self, r: int) -> SuperScales:
        """``d`` repeated ``r`` times (one per ``per / r`` scale groups)."""
        return SuperScales(self.sc, self.mn, np.repeat(self.d, r, axis=1), np.repeat(self.dm, r, axis=1))

    def halved(self) -> SuperScales:
        """A scale per 16 values instead of per 32."""
        return SuperScales(np.repeat(self.sc, 2, axis=1), np.repeat(self.mn, 2, axis=1), self.d, self.dm)


@dataclass
class QuantWeight:
    """``w[n, k] = s[n, k // g] * u[n, k] + m[n, k // g]`` with ``u < 2**bits``, ``g = group``
    (32, or 16 for the K-quants with 16-element sub-blocks). ``u``, ``s`` and ``m`` are numpy
    arrays, or torch tensors on the GPU that quantized them in situ (they stay there: the packed
    matrix is built on the device); ``sup`` and ``perm`` are numpy. ``s`` and ``m`` are float32,
    or float16 where the file holds them so (exact either way).

    ``nibbles``: a 4-bit ``u`` as GGUF's Q4_0 / Q4_1 blocks pack it (``pack_nibbles``'s layout),
    kept from the file so that loading copies bytes instead of unpacking and repacking them; ``u``
    is then unpacked only if asked for."""

    stored: np.ndarray | torch.Tensor | None  # uint8 [N, K]; None while only ``nibbles`` holds it
    s: np.ndarray | torch.Tensor  # [N, K/group]
    m: np.ndarray | torch.Tensor  # [N, K/group]
    bits: int
    source: str  # what the file held: "Q4_1", "Q8_0", "q4 (in situ)", ...
    group: int = GROUP
    sup: SuperScales | None = None  # the K-quants: s and m from super-block scales
    perm: np.ndarray | None = None  # the input's columns in this weight's order (GPTQ's desc_act)
    nibbles: np.ndarray | None = None  # uint8 [N, K/2]

    @property
    def u(self) -> np.ndarray | torch.Tensor:
        if self.stored is None:
            n = self.nibbles
            self.stored = np.concatenate([n.reshape(n.shape[0], -1, 16) & 15, n.reshape(n.shape[0], -1, 16) >> 4],
                                         axis=2).reshape(n.shape[0], -1)
        return self.stored

    @property
    def shape(self) -> tuple[int, int]:
        if self.stored is None:
            return self.nibbles.shape[0], 2 * self.nibbles.shape[1]
        return self.stored.shape  # type: ignore[return-value]

    def _with(self, rows=slice(None), cols: slice = slice(None), groups: slice = slice(None),
              sup: SuperScales | None = None, perm: np.ndarray | None = None) -> QuantWeight:
        """Rows ``rows`` (a slice or an index array) and columns ``cols`` (a slice on group bounds)."""
        nibbles = None
        if self.stored is None:
            half = slice(None if cols.start is None else cols.start // 2, None if cols.stop is None else cols.stop // 2)
            nibbles = self.nibbles[rows][:, half]
        u = None if nibbles is not None else self.u[rows][:, cols]
        return QuantWeight(u, self.s[rows][:, groups], self.m[rows][:, groups], self.bits, self.source, self.group,
                           sup, perm, nibbles)

    def rows(self, part: range) -> QuantWeight:
        rows = slice(part.start, part.stop)
        return self._with(rows, sup=self.sup.take(rows) if self.sup else None, perm=self.perm)

    def columns(self, part: range) -> QuantWeight:
        """Columns ``part`` of every row; ``part`` must start and end on a group boundary."""
        K = self.shape[1]
        if part.start % GROUP or (part.stop % GROUP and part.stop != K):
            raise ValueError(f"columns {part.start}..{part.stop} do not fall on {GROUP}-element quant groups")
        g = range(part.start // self.group, -(-part.stop // self.group))
        return self._with(cols=slice(part.start, part.stop), groups=slice(g.start, g.stop),
                          sup=self.sup.scale_groups(g) if self.sup else None)

    def on_host(self) -> QuantWeight:
        """The same weight with ``u``, ``s`` and ``m`` as numpy arrays."""
        if not torch.is_tensor(self.stored):
            return self
        return QuantWeight(_host(self.u), _host(self.s), _host(self.m), self.bits, self.source, self.group,
                           self.sup, self.perm)

    def dequantize(self) -> np.ndarray:
        if torch.is_tensor(self.stored):
            return self.on_host().dequantize()
        N, K = self.shape
        u = self.u.reshape(N, K // self.group, self.group).astype(np.float32)
        w = (self.s[..., None] * u + self.m[..., None]).astype(np.float32, copy=False).reshape(N, K)
        if self.perm is None:
            return w
        out = np.empty_like(w)
        out[:, self.perm] = w  # the columns back in the input's order
        return out

    def with_rows(self, order: np.ndarray) -> QuantWeight:
        return self._with(order, sup=self.sup.take(order) if self.sup else None)

    def with_column_order(self, order: np.ndarray) -> QuantWeight:
        """Columns ``order``, which moves whole quant groups (a K-quant's super-block scales are
        repeated per scale group first)."""
        g = self.group
        groups = order.reshape(-1, g)[:, 0] // g
        if not np.array_equal(order.reshape(-1, g), groups[:, None] * g + np.arange(g)):
            raise ValueError(f"a column order must move whole {g}-element quant groups")
        sup = None
        if self.sup is not None:
            e = self.sup.expanded(self.sup.per)
            sup = SuperScales(e.sc[:, groups], e.mn[:, groups], e.d[:, groups], e.dm[:, groups])
        return QuantWeight(self.u[:, order], self.s[:, groups], self.m[:, groups], self.bits, self.source, g, sup)

    def in_groups_of(self, group: int) -> QuantWeight:
        """The same weight with a scale per ``group`` (a divisor of this one's group)."""
        r = self.group // group
        if r == 1:
            return self
        return QuantWeight(self.stored, _repeat(self.s, r), _repeat(self.m, r), self.bits,
                           self.source, group, self.sup.halved() if self.sup else None, nibbles=self.nibbles)


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    perm = parts[0].perm
    if any((p.perm is None) != (perm is None) or (perm is not None and not np.array_equal(p.perm, perm))
           for p in parts):
        raise ValueError("fused packed weights must read their input's columns in one order")
    parts = [p.in_groups_of(group) for p in parts]
    sources = sorted({p.source for p in parts if p.source})
    sup = None
    if all(p.sup is not None for p in parts):  # else the float16 s and m carry them (rounded)
        sups = [p.sup for p in parts]
        if len({s.per for s in sups}) > 1:
            sups = [s.expanded(s.per) for s in sups]
        sup = SuperScales(*(np.concatenate([getattr(s, f) for s in sups]) for f in ("sc", "mn", "d", "dm")))
    s, m = _cat([p.s for p in parts]), _cat([p.m for p in parts])
    if all(p.stored is None for p in parts):
        return QuantWeight(None, s, m, bits, "+".join(sources), group, sup, perm, np.concatenate([p.nibbles for p in parts]))
    return QuantWeight(_cat([p.u for p in parts]), s, m, bits, "+".join(sources), group, sup, perm)


def _cat(arrays: list) -> np.ndarray | torch.Tensor:
    """Rows stacked: on the device where any part is a device tensor (the others go up to it)."""
    on = next((a.device for a in arrays if torch.is_tensor(a)), None)
    if on is None:
        return np.concatenate(arrays)
    return torch.cat([a if torch.is_tensor(a) else torch.from_numpy(np.ascontiguousarray(a)).to(on) for a in arrays])


def _repeat(a: np.ndarray | torch.Tensor, r: int) -> np.ndarray | torch.Tensor:
    return a.repeat_interleave(r, dim=1) if torch.is_tensor(a) else np.repeat(a, r, axis=1)


# ---------------------------------------------------------------------------------- GGUF blocks

_FLOAT = (Q.F32, Q.F16, Q.BF16)


def is_quantized(qtype: Q) -> bool:
    return qtype not in _FLOAT and qtype not in (Q.I8, Q.I16, Q.I32, Q.I64, Q.F64)


def decode_blocks(raw: np.ndarray, qtype: Q) -> QuantWeight:
    """A 2-D GGUF tensor's raw bytes (rows x bytes) as groups of 32."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, raw.shape[-1]).view(np.uint8)
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    b = blocks.reshape(-1, size)
    name = qtype.name
    if qtype in (Q.Q4_0, Q.Q4_1):  # the file's bytes as they are: nibbles and float16 scales
        d, first = _half(b[:, 0:2]), 2 if qtype == Q.Q4_0 else 4
        m = -8 * d if qtype == Q.Q4_0 else _half(b[:, 2:4])
        return QuantWeight(None, d.reshape(rows, -1), m.reshape(rows, -1), 4, name,
                           nibbles=np.ascontiguousarray(b[:, first:first + 16]).reshape(rows, -1))
    elif qtype == Q.Q8_0:
        d = _half(b[:, 0:2])
        u = b[:, 2:34] ^ np.uint8(128)  # the int8 + 128
        s, m, bits = d, -128 * d, 8
    elif qtype in (Q.Q5_0, Q.Q5_1):
        off = 2 if qtype == Q.Q5_0 else 4
        qh = b[:, off:off + 4].copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
        u = _nibbles(b[:, off + 4:off + 20]) | (((qh & 1).astype(np.uint8)) << 4)
        d = _f16(b[:, 0:2])
        s, m = (d, -16 * d) if qtype == Q.Q5_0 else (d, _f16(b[:, 2:4]))
        bits = 5
    elif qtype in (Q.Q4_K, Q.Q5_K):
        n = b.shape[0]
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        s = (d * sc.astype(np.float32)).reshape(n * 8)
        m = ((-dmin) * mn.astype(np.float32)).reshape(n * 8)
        sup = _super(rows, sc, mn, d, -dmin)
        qs = b[:, 16:144] if qtype == Q.Q4_K else b[:, 48:176]
        ql = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
        u = ql.reshape(n * 8, 32)
        bits = 4
        if qtype == Q.Q5_K:
            qh = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            u = u | (qh.reshape(n * 8, 32) << 4)
            bits = 5
        return QuantWeight(u.reshape(rows, -1).astype(np.uint8), s.reshape(rows, -1).astype(np.float32),
                           m.reshape(rows, -1).astype(np.float32), bits, name, sup=sup)
    elif qtype in (Q.Q6_K, Q.Q3_K, Q.Q2_K):
        u, (sc, mn, d, dm), bits = _kquant16(b, qtype)
        s, m = d * sc.astype(np.float32), dm * mn.astype(np.float32)
        return QuantWeight(u.reshape(rows, -1).astype(np.uint8), s.reshape(rows, -1).astype(np.float32),
                           m.reshape(rows, -1).astype(np.float32), bits, name, group=16,
                           sup=_super(rows, sc, mn, d, dm))
    else:
        return requantize_q8(dequantize(np.ascontiguousarray(raw), qtype).astype(np.float32), f"{name}, requantized")
    return QuantWeight(u.reshape(rows, -1).astype(np.uint8, copy=False), s.reshape(rows, -1), m.reshape(rows, -1),
                       bits, name)


def _super(rows: int, sc: np.ndarray, mn: np.ndarray, d: np.ndarray, dm: np.ndarray) -> SuperScales:
    return SuperScales(sc.astype(np.int8).reshape(rows, -1), mn.astype(np.int8).reshape(rows, -1),
                       d.astype(np.float16).reshape(rows, -1), dm.astype(np.float16).reshape(rows, -1))


def _kquant16(b: np.ndarray, qtype: Q) -> tuple[np.ndarray, tuple[np.ndarray, ...], int]:
    """Q6_K / Q3_K / Q2_K blocks of 256 as 16 sub-blocks of 16: u, the super-block scales
    (sc, mn, d, dm: s = d * sc, m = dm * mn) and the bits of u."""
    n = b.shape[0]
    if qtype == Q.Q6_K:  # ql[128] qh[64] scales int8[16] d
        ql = (b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
        qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        u = ql.reshape(n, 256) | (qh.reshape(n, 256) << 4)
        sc, d = b[:, 192:208].copy().view(np.int8), _f16(b[:, 208:210])
        return u, (sc, sc, d, -32 * d), 6
    if qtype == Q.Q2_K:  # scales[16] qs[64] d dmin
        sc = b[:, :16]
        u = (b[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        return u.reshape(n, 256), (sc & 15, sc >> 4, _f16(b[:, 80:82]), -_f16(b[:, 82:84])), 2
    # Q3_K: hmask[32] qs[64] scales[12] d; q = low 2 bits - 4 where the mask bit is clear
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    lo = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16) & 15
    hi = (packed[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16) & 3
    scales = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.float32)
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    qh = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    u = ql.reshape(n, 256) | (qh.reshape(n, 256) << 2)
    d = _f16(b[:, 108:110])
    return u, (scales.astype(np.int8), scales.astype(np.int8), d, -4 * d), 3


def _f16(two: np.ndarray) -> np.ndarray:
    return _half(two).astype(np.float32)


def _half(two: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two).view(np.float16).reshape(-1, 1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles first, then high (Q4_0 / Q4_1 / Q5_x order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


# ---------------------------------------------------------------------------------- in situ


def quantize(w: torch.Tensor, scheme: str, device: torch.device | None = None) -> QuantWeight:
    """Quantize a float weight [N, K] (K a multiple of 32) with ``scheme``; scales are rounded
    first (to float16, and for q4 to what bfloat16 holds too), so every packed form holds exactly
    what this returns. ``device``: where to compute it (a rank's GPU: its load's in-situ
    quantization, a sixth of the time on the host's cores); a GPU's result stays on it."""
    x = w.detach().to(device or "cpu").float().reshape(w.shape[0], -1, GROUP)
    out = _host if x.device.type == "cpu" else (lambda t: t)
    if scheme == "q8_0":
        d = _round_f16(_over(x.abs().amax(-1), 127))
        q = torch.round(x / torch.where(d == 0, 1, d)[..., None]).clamp(-127, 127)
        return QuantWeight(out((q + 128).to(torch.uint8).reshape(w.shape)), out(d), out(-128 * d), 8,
                           "q8_0 (in situ)")
    if scheme == "q4":
        s, m = _q4_scales(x.amin(-1), x.amax(-1))
        q = torch.round((x - m[..., None]) / torch.where(s == 0, 1, s)[..., None]).clamp(0, 15)
        return QuantWeight(out(q.to(torch.uint8).reshape(w.shape)), out(s), out(m), 4, "q4 (in situ)")
    raise ValueError(f"unknown quantization {scheme!r} (known: {', '.join(SCHEMES)})")


def _over(t: torch.Tensor, d: float) -> torch.Tensor:
    """``t / d`` correctly rounded on every device: CUDA divides by a Python number as a product
    with its reciprocal (one bit off at times), by a tensor on the device truly."""
    return t / torch.tensor(d, dtype=t.dtype, device=t.device)


def _host(t: torch.Tensor | np.ndarray) -> np.ndarray:
    return t.cpu().numpy() if torch.is_tensor(t) else t


def _q4_scales(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and offset of q4 groups spanning ``lo..hi``: float16s (what the packed forms hold),
    with ``s`` and ``m + 8 s`` (the weight at q = 8) also bfloat16s, the form torch's tensor-core
    int4 kernel took when the GPU ran it (before the int8-activation kernel replaced it); kept so
    that in-situ q4 weights quantize as before. The weight at q = 8 is rounded to a grid that both
    allow (a few 1/1000 of a step)."""
    s = _round_f16(_over(hi - lo, 15).to(torch.bfloat16).float())
    zero = _on_both_grids(lo + 8 * s, lo)
    m = zero - 8 * s
    far = _round_f16(m) != m
    if far.any():  # |m| > ~30 s, a group far from 0: s on the float16 grid of m, wide enough for it
        grid = torch.exp2(_exponent(lo[far]) - 9)
        slack = torch.exp2(_exponent(lo[far] + 8 * s[far]) - 7)  # the weight at q = 8 moves by <= half of this
        s_far = torch.ceil(_over(hi[far] - lo[far] + slack, 15) / grid) * grid
        zero_far = _on_both_grids((lo[far] + hi[far] + s_far) / 2, lo[far])  # the middle, where q = 7.5
        s[far], m[far] = s_far, zero_far - 8 * s_far
    return s, m  # a group that still misses (tiny and far from 0) keeps its matrix off the int4 kernel


def _exponent(v: torch.Tensor) -> torch.Tensor:
    """floor(log2 |v|), exactly (frexp), so every device computes the same grids: log2 rounds a
    value just under a power of two up to it, and the CPU and a GPU do not round alike."""
    return (torch.frexp(v.abs().clamp(min=2**-126))[1] - 1).to(v.dtype)


def _on_both_grids(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``v`` rounded to a bfloat16 that also lies on the float16 grid of numbers near ``m``."""
    grid = torch.maximum(torch.exp2(_exponent(v) - 7), torch.exp2(torch.clamp(_exponent(m) + 1, min=-14) - 10))
    return torch.round(v / grid) * grid


def requantize_q8(w: np.ndarray, source: str) -> QuantWeight:
    q = quantize(torch.from_numpy(w), "q8_0")
    q.source = source
    return q


def _round_f16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).float()
