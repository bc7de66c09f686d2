"""The inputs of a step that runs eagerly (no CUDA graph): its rows on the device and the
attention's metadata for them, by the kernels the rank has (Triton on CUDA, C++ on the CPU in
float32, gathered keys for SDPA elsewhere)."""

from __future__ import annotations

import numpy as np
import torch

import protocol as p

from .attention import PrefillSpan, StepMeta
from .inputs import flatten, key_rows, prefill_batch, state_spans
from .sampler import upload


def eager_inputs(runner, seqs: list[p.StepSeq], states: bool = True):
    """``seqs``' rows as (ids, positions, table rows) on the device, ids of device tokens not yet
    resolved, the attention's ``StepMeta`` and each seq's last row; ``states``: with the spans of
    the recurrent layers (a step of the model; not for a layer without them)."""
    r = runner
    ids, positions, slot_of, store, decode_rows, prefills, ends = flatten(seqs, r.tables_host, r.bs)
    T = len(ids)
    if not r.triton and r.cpu_kernels is not None:
        # The C++ attention takes a prompt's rows as it takes decodes (kernels/csrc/attention.h):
        # a row's sums then do not depend on the rest of the step or on its prompt's chunks.
        decode_rows, prefills = list(range(T)), []
    # Rows of an even length: each starts 16-byte aligned whatever T, as Triton assumes of the
    # pointers it compiled a kernel for (an odd T compiled rope_store anew: seconds of a prompt)
    rows = np.zeros((4, T + T % 2), np.int64)
    rows[:, :T] = (ids, positions, slot_of, store)
    ids_t, pos_t, slot_t, store_t = upload(rows, torch.int64, r.device)[:, :T]
    meta = StepMeta(store_index=store_t, decode_rows=None,
                    state_spans=state_spans(seqs, r.device, r.triton) if states and r.states.slots else None)
    if len(decode_rows) < T:
        meta.decode_rows = upload(decode_rows, torch.int64, r.device)
    if decode_rows:
        d = np.array(decode_rows)
        ctx = positions[d] + 1
        meta.decode_max_ctx = int(ctx.max())
        if r.triton:
            meta.decode_slots = slot_t[meta.decode_rows] if meta.decode_rows is not None else slot_t
            meta.decode_ctx = upload(ctx, torch.int32, r.device)
            shape = r.model.attention_shape
            heads = shape.n_kv if shape.gqa_repeat else shape.n_q
            from neuron.kernels.gpu import decode_splits
            # By the longest context, as the decode graphs split: a split count is a kernel of its
            # own, and one by each step's context compiled a new one as the contexts grew.
            meta.decode_splits = decode_splits(len(d), heads, r.cfg.max_len, r.sm_count)
        elif r.cpu_kernels is not None:
            meta.decode_slots = slot_t[meta.decode_rows] if meta.decode_rows is not None else slot_t
            meta.decode_ctx = torch.from_numpy(ctx)
        else:
            C = meta.decode_max_ctx
            keys = key_rows(r.tables_host, r.bs, slot_of[d][:, None], np.arange(C)[None, :])
            meta.decode_keys = upload(keys, torch.int64, r.device)
            meta.decode_mask = upload(np.arange(C)[None, :] < ctx[:, None], torch.bool, r.device)[:, None, None, :]
    if prefills and r.triton:  # the kernel reads the keys through the block table itself
        meta.prefill_spans = upload(prefills, torch.int32, r.device)
        meta.prefill_max_n = max(n for _, n, _, _ in prefills)
    elif len(prefills) > 2:
        meta.prefill_batch = prefill_batch(r.tables_host, r.bs, prefills, r.device)
    else:
        for row, n, slot, start in prefills:
            keys = key_rows(r.tables_host, r.bs, np.int64(slot), np.arange(start + n))
            meta.prefills.append(PrefillSpan(row, n, upload(keys, torch.int64, r.device)))
    return ids_t, pos_t, slot_t, meta, ends, positions
