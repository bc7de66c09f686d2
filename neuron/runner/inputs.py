"""A step's sequences as the device's inputs: the checks a step must pass before anything runs,
and its tokens flattened into rows with their positions, table rows and cache rows."""

from __future__ import annotations

import numpy as np
import torch

import protocol as p

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
        _check_state(runner, s, states)
        if s.sampling is not None:
            why = check_sampling(s.sampling, vocab)
            if why:
                raise StepRejected(f"slot {s.slot}: {why}")
        if s.allowed is not None and len(s.allowed) != 4 * ((vocab + 31) // 32):
            raise StepRejected(f"slot {s.slot}: the token mask does not match the vocabulary")
        if s.context and (s.sampling is None or len(s.context) != s.start_pos
                          or any(not 0 <= t < vocab for t in s.context)):
            raise StepRejected(f"slot {s.slot}: context must be the sequence's tokens before start_pos")


def _check_state(runner, s: p.StepSeq, seen: set[int]) -> None:
    pool = runner.states
    if not pool.slots:
        if s.state != -1:
            raise StepRejected(f"slot {s.slot}: this model keeps no per-sequence state")
        return
    if not 0 <= s.state < pool.slots or s.state in seen:
        raise StepRejected(f"slot {s.slot}: state slot {s.state} is out of range or twice in the step")
    seen.add(s.state)
    if s.sampling is not None and s.start_pos != 0:
        raise StepRejected(f"slot {s.slot}: a sequence with recurrent state must start at position 0")


def flatten(seqs: list[p.StepSeq], tables_host: np.ndarray, bs: int):
    """The step's tokens as rows: (ids, positions, slots, cache rows) [T] each, the rows of the
    single-token decodes, (row, n, slot, start) of each prompt chunk, each sequence's last row."""
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
        if n == 1:
            decode_rows.append(row)
        else:
            prefills.append((row, n, s.slot, s.start_pos))
        row += n
        ends.append(row - 1)
    store = tables_host[slot_of, positions // bs].astype(np.int64) * bs + positions % bs
    return ids, positions, slot_of, store, decode_rows, prefills, ends


def key_rows(tables_host: np.ndarray, bs: int, slot: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Flat cache rows of the keys at ``pos`` of the sequences in table rows ``slot``."""
    return tables_host[slot, pos // bs].astype(np.int64) * bs + pos % bs


def seq_states(seqs: list[p.StepSeq]) -> list[tuple[int, int, int]]:
    """Each sequence's (first token row, tokens, state slot), in step order."""
    out, row = [], 0
    for s in seqs:
        out.append((row, len(s.tokens), s.state))
        row += len(s.tokens)
    return out


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
