"""The references the attention kernels (Triton and C++) are checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron.models.ops import RopeTables, TorchOps


def reference_decode(q, kc, vc, tables, slots, ctx, kv_of_q, scale):
    """Attention of each row's query over its sequence's keys, read position by position."""
    bs = kc.shape[1]
    out = []
    for b in range(q.shape[0]):
        pos = torch.arange(int(ctx[b]))
        block = tables[slots[b], pos // bs].long()
        k, v = kc[block, pos % bs][:, kv_of_q].double(), vc[block, pos % bs][:, kv_of_q].double()
        p = (torch.einsum("hd,nhd->hn", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


@dataclass
class RopeCase:
    """Three tokens' qkv [T, n_q + 2 n_kv, hd], their positions and RoPE tables, the optional q/k
    norms, the reference rotated q and k, and the cache rows their K/V go to."""

    qkv: torch.Tensor
    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    qn: torch.Tensor | None
    kn: torch.Tensor | None
    q: torch.Tensor
    k: torch.Tensor
    rows: torch.Tensor
    n_q: int = 4
    n_kv: int = 2
    hd: int = 16

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(4, 4, self.n_kv, self.hd), torch.zeros(4, 4, self.n_kv, self.hd)

    def check(self, got: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> None:
        """q rotated in place, k and v in their cache rows and nowhere else, v left in qkv."""
        n_q, n_kv, hd = self.n_q, self.n_kv, self.hd
        assert (got[:, :n_q] - self.q).abs().max() < 1e-5
        assert (kc.view(-1, n_kv, hd)[self.rows] - self.k).abs().max() < 1e-5
        assert torch.equal(vc.view(-1, n_kv, hd)[self.rows], self.qkv[:, n_q + n_kv:])
        assert torch.equal(got[:, n_q + n_kv:], self.qkv[:, n_q + n_kv:])
        kc.view(-1, n_kv, hd)[self.rows] = 0
        vc.view(-1, n_kv, hd)[self.rows] = 0
        assert not kc.any() and not vc.any()


def rope_case(norm: bool) -> RopeCase:
    g = torch.Generator().manual_seed(4)
    T, n_q, n_kv, hd = 3, 4, 2, 16
    qkv = torch.randn(T, n_q + 2 * n_kv, hd, generator=g)
    pos = torch.tensor([0, 5, 9])
    angles = torch.randn(20, hd // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    qn, kn = (torch.randn(hd, generator=g), torch.randn(hd, generator=g)) if norm else (None, None)
    q, k = TorchOps().qk_norm_rope(qkv[:, :n_q], qkv[:, n_q: n_q + n_kv], pos, RopeTables(cos, sin), qn, kn, 1e-6)
    return RopeCase(qkv, pos, cos, sin, qn, kn, q, k, torch.tensor([5, 0, 14]), n_q, n_kv, hd)


def reference_prefill(q, kc, vc, tables, spans, kv_of_q, scale):
    """Each chunk's queries over its sequence's keys, read position by position: query i of a
    chunk (row, n, table row, start) is at position start + i and sees keys 0 ..= start + i.
    Rows of q outside every chunk are left zero."""
    bs = kc.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row, n, slot, start in spans.tolist():
        pos = torch.arange(start + n)
        block = tables[slot, pos // bs].long()
        k, v = kc[block, pos % bs][:, kv_of_q].double(), vc[block, pos % bs][:, kv_of_q].double()
        s = torch.einsum("ihd,chd->hic", q[row: row + n].double(), k) * scale
        seen = pos[None, :] <= start + torch.arange(n)[:, None]  # [n, C]
        p = s.masked_fill(~seen, float("-inf")).softmax(-1)
        out[row: row + n] = torch.einsum("hic,chd->ihd", p, v)
    return out
