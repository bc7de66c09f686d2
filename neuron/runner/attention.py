"""Attention over the paged KV cache.

The cache holds, per layer, ``[blocks + 1, block_size, n_kv, head_dim]`` for K and for V; the
last block is scratch (padded rows of a CUDA graph write there, unused table entries point
there). A sequence's keys are found through its row of the block table. A step's tokens are
either single-token decodes (one Triton flash-decoding kernel on CUDA, one C++ kernel over the
paged cache on the CPU in float32, one batched SDPA over gathered keys elsewhere) or prompt
chunks (one Triton flash-attention kernel over the paged cache for all of them on CUDA, SDPA
over each chunk's gathered keys elsewhere), causal from the bottom right, since a chunk's
queries are the last rows of its sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from neuron.models.interface import AttentionShape
from neuron.models.ops import Rotary, StateSpans, TorchOps

from .host_memory import zeroed

# cuDNN's attention builds an execution plan for every new shape, tens of milliseconds each on an
# H200, and a prompt chunk's key length is new almost every time. The others take any shape.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class PagedKvCache:
    def __init__(self, layers: int, blocks: int, block_size: int, n_kv: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = (layers, blocks + 1, block_size, n_kv, head_dim)
        self.k, self.v = zeroed((2, *shape), device, dtype, "KV cache").unbind(0)
        self.blocks, self.block_size, self.scratch = blocks, block_size, blocks

    @staticmethod
    def bytes_per_block(layers: int, block_size: int, n_kv: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * block_size * n_kv * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Blocks ``pairs[1]`` of every layer take the K/V of blocks ``pairs[0]``."""
        for cache in (self.k, self.v):
            cache.index_copy_(1, pairs[1], cache.index_select(1, pairs[0]))


@dataclass
class PrefillSpan:
    row: int  # first token row of the chunk in the step
    n: int  # its tokens
    keys: torch.Tensor  # [C] flat cache rows of the sequence's keys 0..C-1 (C = start + n)


@dataclass
class PrefillBatch:
    """Several prompt chunks attended in one call: padded to the longest chunk and the longest
    key range, the padding masked out (a step with many short prompts would otherwise launch a
    dozen kernels per prompt per layer)."""

    q_rows: torch.Tensor  # [S, n_max] the token row of each query (padding: row 0)
    keys: torch.Tensor  # [S, C_max] flat cache rows of each sequence's keys (padding: any row)
    mask: torch.Tensor  # [S, 1, n_max, C_max] True where a query may attend a key
    picked: torch.Tensor  # [R] positions in the flattened [S * n_max] that are real queries
    rows: torch.Tensor  # [R] their token rows


@dataclass
class StepMeta:
    """Where a step's tokens sit in the cache; built once per step, read by every layer."""

    # [T] flat cache row (block * block_size + offset) of each token; None in a decode graph (the
    # Triton path), whose kernels find it in the block table from the slot and the position
    store_index: torch.Tensor | None
    decode_rows: torch.Tensor | None  # rows of the single-token decodes; None when every row is one
    decode_slots: torch.Tensor | None = None  # [D] their block-table rows
    decode_ctx: torch.Tensor | None = None  # [D] int32 keys of each (the new one included); None as above
    decode_max_ctx: int = 0  # bound of decode_ctx: it sizes decode_splits
    decode_splits: int = 1
    decode_keys: torch.Tensor | None = None  # [D, C] flat key rows, for the gather path (no Triton)
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, C] True where a key is the sequence's
    prefills: list[PrefillSpan] = field(default_factory=list)
    prefill_batch: PrefillBatch | None = None
    # The Triton path's prompt chunks instead of the two above: [S, 4] int32 (first row, tokens,
    # table row, start position) each, and the bound of their token counts (it fixes the grid).
    prefill_spans: torch.Tensor | None = None
    prefill_max_n: int = 0
    prefill_splits: int = 1  # key ranges per tile (a prefill graph's rows are all chunks or padding)
    prefill_work: torch.Tensor | None = None  # a prefill graph's: its chunks' tiles (kernels/prefill_work.py)
    # A prefill graph's: where each of decode_rows goes in the output ([D], padding rows: a spare
    # row T past the step's, dropped), after the prefill kernel has written every row.
    decode_out: torch.Tensor | None = None
    # For recurrent layers: the step's sequences (their rows and state slots).
    state_spans: StateSpans | None = None
    images: Any = None  # a step with image sequences: runner.images.StepImages


class PagedAttention:
    """The ``attend(layer, qkv, positions, rotary)`` the model calls; ``meta`` is set by the runner
    each step. Recurrent layers find their state in ``states`` and ``meta.state_spans``."""

    def __init__(self, kv: PagedKvCache, tables: torch.Tensor, shape: AttentionShape, triton: bool,
                 max_rows: int = 1, cpu_kernels=None, int8_rows: int = 0, states=None) -> None:
        """``int8_rows``: a decode step of at most this many rows also writes its output's int8
        form (``out.int8_rows``), which the packed output projection reads instead of quantizing
        it in a launch of its own."""
        self.kv, self.tables, self.shape = kv, tables, shape
        self.states = states  # the StatePool of the model's recurrent layers, if it has any
        self.triton = triton
        self.cpu = cpu_kernels  # the C++ ops (float32 on the CPU), or None
        self.kv_of_q = torch.tensor(shape.kv_of_q, device=tables.device, dtype=torch.int32)
        self.kv_index = self.kv_of_q.long()
        self.meta: StepMeta | None = None
        if triton:
            from neuron.kernels import gpu as kernels
            self.kernels = kernels
            self.int8_rows = int8_rows if kernels.quantizable(shape.head_dim) else 0
            # The split-K decode kernel's per-(sequence, head) arrival counters: left zero.
            self.counters = torch.zeros(max_rows * shape.n_q, dtype=torch.int32, device=tables.device)

    def __call__(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        meta = self.meta
        assert meta is not None
        s = self.shape
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        if self.triton:
            self.kernels.rope_store(qkv, s.n_q, s.n_kv, positions, rotary.rope.cos, rotary.rope.sin, rotary.q_norm,
                                    rotary.k_norm, rotary.eps, kc, vc, meta.store_index, self.tables,
                                    meta.decode_slots)
            q = qkv[:, : s.n_q]
        elif self.cpu is not None:
            self.cpu.rope_store(qkv, s.n_q, s.n_kv, positions, rotary.rope.cos, rotary.rope.sin, rotary.q_norm,
                                rotary.k_norm, rotary.eps, kc, vc, meta.store_index)
            q = qkv[:, : s.n_q]
        else:
            q, k = TorchOps().qk_norm_rope(qkv[:, : s.n_q], qkv[:, s.n_q: s.n_q + s.n_kv], positions, rotary.rope,
                                           rotary.q_norm, rotary.k_norm, rotary.eps)
            kc.view(-1, *kc.shape[2:]).index_copy_(0, meta.store_index, k)
            vc.view(-1, *vc.shape[2:]).index_copy_(0, meta.store_index, qkv[:, s.n_q + s.n_kv:])
        T, n_q, hd = q.shape
        if meta.decode_rows is None:
            if not self.triton or T > self.int8_rows:
                return self._decode(q, kc, vc, meta, positions=positions).view(T, n_q * hd)
            rows = self.kernels.int8_rows_buffers(T, n_q * hd, q.device)
            out = self._decode(q, kc, vc, meta, rows, positions).view(T, n_q * hd)
            out.int8_rows = rows
            return out
        # Zeros: a graph's padding rows belong to no span and must stay finite.
        spare = int(meta.decode_out is not None)
        out = q.new_zeros(T + spare, n_q, hd) if meta.prefill_spans is not None else q.new_empty(T, n_q, hd)
        if meta.decode_rows.numel() and not spare:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], kc, vc, meta)
        if meta.prefill_spans is not None:
            self.kernels.paged_prefill(q, kc, vc, self.tables, meta.prefill_spans, self.kv_of_q, s.gqa_repeat,
                                       s.scale, meta.prefill_max_n, out, meta.prefill_splits, meta.prefill_work)
        if spare:
            out.index_copy_(0, meta.decode_out, self._decode(q.index_select(0, meta.decode_rows), kc, vc, meta))
            out = out[:T]
        for span in meta.prefills:
            out[span.row: span.row + span.n] = self._prefill(q[span.row: span.row + span.n], kc, vc, span.keys)
        if meta.prefill_batch is not None:
            pb = meta.prefill_batch
            keys = kc.view(-1, *kc.shape[2:])[pb.keys]  # [S, C, n_kv, hd]
            values = vc.view(-1, *vc.shape[2:])[pb.keys]
            got = self._sdpa(q[pb.q_rows], keys, values, pb.mask).transpose(1, 2)  # [S, n_max, n_q, hd]
            out[pb.rows] = got.reshape(-1, n_q, hd)[pb.picked]
        return out.view(T, n_q * hd)

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: StepMeta,
                int8_rows: tuple[torch.Tensor, ...] | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: of every row, when they are all decodes (then ``meta.decode_ctx`` may be
        None: positions + 1)."""
        s = self.shape
        if self.triton:
            return self.kernels.paged_decode(q, kc, vc, self.tables, meta.decode_slots, meta.decode_ctx,
                                             self.kv_of_q, s.gqa_repeat, s.scale, meta.decode_splits, self.counters,
                                             int8_rows=int8_rows, positions=positions)
        if self.cpu is not None:
            return self.cpu.paged_decode(q, kc, vc, self.tables, meta.decode_slots, meta.decode_ctx, self.kv_of_q,
                                         s.scale)
        assert meta.decode_keys is not None
        keys = kc.view(-1, *kc.shape[2:])[meta.decode_keys]  # [D, C, n_kv, hd]
        values = vc.view(-1, *vc.shape[2:])[meta.decode_keys]
        out = self._sdpa(q[:, None], keys, values, meta.decode_mask)  # [D, n_q, 1, hd]
        return out[:, :, 0]

    def _prefill(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, keys_at: torch.Tensor) -> torch.Tensor:
        n, C = q.shape[0], keys_at.shape[0]
        keys = kc.view(-1, *kc.shape[2:])[keys_at][None]  # [1, C, n_kv, hd]
        values = vc.view(-1, *vc.shape[2:])[keys_at][None]
        if n == C:
            mask = None  # the whole sequence: plain causal
        else:  # query i is position C - n + i: it sees keys 0 ..= C - n + i
            mask = torch.ones(n, C, dtype=torch.bool, device=q.device).tril(C - n)[None, None]
        return self._sdpa(q[None], keys, values, mask, causal=mask is None)[0].transpose(0, 1)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              causal: bool = False) -> torch.Tensor:
        """q [B, n, n_q, hd], keys/values [B, C, n_kv, hd] -> [B, n_q, n, hd]."""
        s = self.shape
        if s.gqa_repeat != 1:
            if s.gqa_repeat:
                keys = keys.repeat_interleave(s.gqa_repeat, dim=2)
                values = values.repeat_interleave(s.gqa_repeat, dim=2)
            else:
                keys, values = keys[:, :, self.kv_index], values[:, :, self.kv_index]
        with sdpa_kernel(SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                  attn_mask=mask, is_causal=causal, scale=s.scale)
