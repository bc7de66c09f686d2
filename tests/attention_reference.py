"""The reference the attention kernels (Triton and C++) are checked against."""

from __future__ import annotations

import torch


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
