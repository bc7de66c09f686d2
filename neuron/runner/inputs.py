"""A step's sequences as the device's inputs: the checks a step must pass before anything runs,
and its tokens flattened into rows with their positions, table rows and cache rows."""

from __future__ import annotations

import numpy as np
import torch

import protocol as p
from neuron.models.ops import StateSpans

from .attention import PrefillBatch
from .sampler import check_sampling, upload

DEVICE_TOKEN = -1  # a decode input the rank takes from its last draw for the slot


class StepRejected(ValueError):
    """The step cannot run as sent (a leader bug or a forged frame): bad_request, nothing ran."""


def check_step(runner, seqs: list[p.StepSeq]) -> None:
    cfg, vocab, bs = runner.cfg, runner.vocab, runner.bs
    slots: set[int] = set()
    states: set[int] = set()
    for s in seqs:
        n = len(s.tokens)
        if not 0 <= s.slot < cfg.max_seqs or s.slot in slots:
            raise StepRejected(f"slot {s.slot} is out of range or twice in the step")
        slots.add(s.slot)
        if not n or s.start_pos < 0 or s.start_pos + n > cfg.max_len:
            raise StepRejected(f"seq in slot {s.slot} does not fit the context ({cfg.max_len} tokens)")
        if s.tokens == [DEVICE_TOKEN]:
            if s.start_pos == 0:
                raise StepRejected(f"slot {s.slot}: a device token cannot start a sequence")
        elif any(not 0 <= t < vocab for t in s.tokens):
            raise StepRejected(f"seq in slot {s.slot} has a token outside the vocabulary")
        if s.block_start < 0 or s.block_start + len(s.blocks) > runner.max_blocks:
            raise StepRejected(f"slot {s.slot}: block table entries out of range")
        if any(not 0 <= b < runner.kv.blocks for b in s.blocks):
            raise StepRejected(f"slot {s.slot}: a block outside the KV cache")
        # A new sequence (sampling set) fills its table from entry 0; later steps only extend it.
        before = 0 if s.sampling is not None else runner.assigned[s.slot]
        if s.blocks and s.block_start > before:
            raise StepRejected(f"slot {s.slot}: block table entries would leave a gap")
        assigned = max(before, s.block_start + len(s.blocks)) if s.blocks else before
        if assigned * bs < s.start_pos + n:
            raise StepRejected(f"slot {s.slot}: positions up to {s.start_pos + n} have no KV blocks")
        if s.drafts and (not 0 < s.drafts < n or s.drafts > p.MAX_DRAFTS or not s.sample
                         or runner.stage_tokens is not None):
            raise StepRejected(f"slot {s.slot}: drafts must be fewer than the tokens of a sampled seq (at most "
                               f"{p.MAX_DRAFTS}), of a model without pipeline stages")
        if s.propose and (not 0 < s.propose <= p.MAX_DRAFTS or getattr(runner, "mtp", None) is None):
            raise StepRejected(f"slot {s.slot}: propose needs a model with its MTP layer loaded, and at most "
                               f"{p.MAX_DRAFTS} drafts")
        _check_state(runner, s, states)
        if s.sampling is not None:
            why = check_sampling(s.sampling, vocab)
            if why:
                raise StepRejected(f"slot {s.slot}: {why}")
        if s.mask_later and (not s.sample or s.allowed is not None or s.drafts
                             or runner.stage_tokens is not None):
            raise StepRejected(f"slot {s.slot}: mask_later is for a sampled row without a mask or drafts, of a "
                               f"model without pipeline stages")
        if s.allowed is not None and len(s.allowed) != 4 * ((vocab + 31) // 32):
            raise StepRejected(f"slot {s.slot}: the token mask does not match the vocabulary")
        if s.context and (s.sampling is None or len(s.context) != s.start_pos
                          or any(not 0 <= t < vocab for t in s.context)):
            raise StepRejected(f"slot {s.slot}: context must be the sequence's tokens before start_pos")


def _check_state(runner, s: p.StepSeq, seen: set[int]) -> None:
    pool, n = runner.states, len(s.tokens)
    if s.kv_from != -1:
        if s.sampling is None or not 0 <= s.kv_from < runner.kv.blocks or s.start_pos % runner.bs == 0 \
                or not s.block_start <= s.start_pos // runner.bs < s.block_start + len(s.blocks):
            raise StepRejected(f"slot {s.slot}: kv_from needs a new sequence whose first block it fills in part")
    if not pool.slots:
        if s.state != -1 or s.state_from != -1 or s.snapshots:
            raise StepRejected(f"slot {s.slot}: this model keeps no per-sequence state")
        return
    if not 0 <= s.state < pool.slots or s.state in seen:
        raise StepRejected(f"slot {s.slot}: state slot {s.state} is out of range or twice in the step")
    seen.add(s.state)
    if s.sampling is not None and s.start_pos != 0 and s.state_from == -1:
        raise StepRejected(f"slot {s.slot}: a sequence with recurrent state must start at position 0 or from a "
                           "snapshot (state_from)")
    if s.state_from != -1 and (s.sampling is None or s.start_pos == 0 or not 0 <= s.state_from < pool.slots):
        raise StepRejected(f"slot {s.slot}: state_from {s.state_from} must be a state slot (its own: restored from "
                           "the host tier), for a new sequence past position 0")
    for at, slot in s.snapshots:
        if not s.start_pos < at <= s.start_pos + n or not 0 <= slot < pool.slots or slot in seen:
            raise StepRejected(f"slot {s.slot}: snapshot ({at}, {slot}) is outside the step's tokens or its slot "
                               "is out of range or taken")
        seen.add(slot)


def flatten(seqs: list[p.StepSeq], tables_host: np.ndarray, bs: int):
    """The step's tokens as rows: (ids, positions, slots, cache rows) [T] each, the rows of the
    decodes (a seq of one token, or a token and its drafts: a row each, attending to the keys up
    to its own position, its step's own stored first), (row, n, slot, start) of each prompt
    chunk, each sequence's last row."""
    T = sum(len(s.tokens) for s in seqs)
    ids = np.empty(T, dtype=np.int64)
    positions = np.empty(T, dtype=np.int64)
    slot_of = np.empty(T, dtype=np.int64)
    decode_rows: list[int] = []
    prefills: list[tuple[int, int, int, int]] = []  # row, n, slot, start
    ends: list[int] = []
    row = 0
    for s in seqs:
        n = len(s.tokens)
        ids[row: row + n] = s.tokens
        positions[row: row + n] = np.arange(s.start_pos, s.start_pos + n)
        slot_of[row: row + n] = s.slot
        if n == 1 or s.drafts:  # a token and its drafts: each row a decode of its own position
            decode_rows.extend(range(row, row + n))
        else:
            prefills.append((row, n, s.slot, s.start_pos))
        row += n
        ends.append(row - 1)
    store = tables_host[slot_of, positions // bs].astype(np.int64) * bs + positions % bs
    return ids, positions, slot_of, store, decode_rows, prefills, ends


def key_rows(tables_host: np.ndarray, bs: int, slot: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Flat cache rows of the keys at ``pos`` of the sequences in table rows ``slot``."""
    return tables_host[slot, pos // bs].astype(np.int64) * bs + pos % bs


# Sequences of at most this many tokens take the delta rule token after token (one kernel, the
# decode graphs' way); a step with a longer one, or with a snapshot, runs it in chunks.
RECURRENT_TOKENS = 16
CHUNK = 64  # neuron.kernels.deltanet.CHUNK


def state_spans(seqs: list[p.StepSeq], device: torch.device, kernels: bool) -> StateSpans:
    """The step's sequences for its recurrent layers: each one's (first token row, tokens, state
    slot) in step order, its snapshots, and with ``kernels`` the device tables of both."""
    spans, snaps, row = [], [], 0
    for i, s in enumerate(seqs):
        spans.append((row, len(s.tokens), s.state))
        snaps += [(i, at - s.start_pos, slot) for at, slot in s.snapshots]
        row += len(s.tokens)
    max_n = max(n for _, n, _ in spans)
    if not kernels:
        return StateSpans(spans, None, max_n, snaps)
    if max_n <= RECURRENT_TOKENS and not snaps:
        table = np.ascontiguousarray(np.array(spans, dtype=np.int64).T)
        return StateSpans(spans, upload(table, torch.int64, device), max_n)
    table, chunks, conv = chunk_tables(spans, snaps)
    up = lambda a: upload(a, torch.int64, device)  # noqa: E731
    return StateSpans(spans, up(table), max_n, snaps, up(chunks), up(conv) if conv.shape[1] else None)


def chunk_tables(spans: list[tuple[int, int, int]], snaps: list[tuple[int, int, int]], chunks_to: int = 0,
                 snaps_to: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chunked delta rule's tables: the spans [5, S] (first row, tokens, state slot, first
    chunk, chunks), the chunks [3, C] (first row, tokens, slot that takes the state after it or
    -1), each span cut at its snapshots and every ``CHUNK`` tokens (a single token without a
    snapshot is left to the recurrent kernel: no chunk), and the conv snapshots [4, M] (row after
    the point, the span's first row, its state slot, the snapshot's slot), padded to
    ``chunks_to`` and ``snaps_to`` (a graph's sizes) with empty entries."""
    table = np.zeros((5, len(spans)), dtype=np.int64)
    chunks: list[tuple[int, int, int]] = []
    conv: list[tuple[int, int, int, int]] = []
    for i, (first, n, slot) in enumerate(spans):
        cuts = {at: dst for j, at, dst in snaps if j == i}
        conv += [(first + at, first, slot, dst) for at, dst in sorted(cuts.items())]
        table[:, i] = (first, n, slot, len(chunks), 0)
        done = 0 if n > 1 or cuts else n
        while done < n:
            size = min(CHUNK, n - done, min((at for at in cuts if at > done), default=n) - done)
            done += size
            chunks.append((first + done - size, size, cuts.get(done, -1)))
        table[4, i] = len(chunks) - table[3, i]
    chunks += [(0, 0, -1)] * max(0, chunks_to - len(chunks))
    conv += [(0, 0, 0, -1)] * max(0, snaps_to - len(conv))
    as_rows = lambda rows, k: np.ascontiguousarray(np.array(rows, dtype=np.int64).reshape(-1, k).T)  # noqa: E731
    return table, as_rows(chunks, 3), as_rows(conv, 4)


def prefill_batch(tables_host: np.ndarray, bs: int, prefills: list[tuple[int, int, int, int]],
                  device: torch.device):
    n_max = max(n for _, n, _, _ in prefills)
    c_max = max(start + n for _, n, _, start in prefills)
    rows = np.array([row for row, _, _, _ in prefills])[:, None]
    n = np.array([n for _, n, _, _ in prefills])[:, None]
    start = np.array([start for _, _, _, start in prefills])[:, None]
    slots = np.array([slot for _, _, slot, _ in prefills])[:, None]
    r = np.arange(n_max)[None, :]
    real = r < n  # [S, n_max]
    q_rows = np.where(real, rows + r, 0)
    c = np.arange(c_max)[None, None, :]
    mask = (c <= (start + r)[:, :, None]) & real[:, :, None]  # causal: query r is position start + r
    mask[:, :, 0] |= ~real  # a padding query attends one key, so its (discarded) row stays finite
    keys = key_rows(tables_host, bs, slots, np.minimum(np.arange(c_max)[None, :], (start + n - 1)))
    picked = np.flatnonzero(real)
    up = lambda a, dtype=torch.int64: upload(a, dtype, device)  # noqa: E731
    return PrefillBatch(up(q_rows), up(keys), up(mask, torch.bool)[:, None], up(picked), up(q_rows.ravel()[picked]))
