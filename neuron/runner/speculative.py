"""Speculative decoding on the rank: a step whose seqs carry drafts (``StepSeq.drafts``) has
the logits of every draft's position; each such seq keeps the drafts its own draws confirm
(``DeviceSampler.verify``), the others sample as in any step."""

from __future__ import annotations

import numpy as np
import torch

import protocol as p

from .sampler import upload


def verify_drafts(runner, seqs: list[p.StepSeq], sampled: list[int], logits: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """A step with drafts: ``logits`` holds each sampled seq's rows (one, or one per draft and
    one more); the seqs without drafts sample from their row, those with drafts verify them.
    Returns the last token drawn for each sampled seq, the drafts each accepted, and the
    logprobs of the seqs without drafts that asked for them (``DeviceSampler.sample``'s, a row
    for every sampled seq)."""
    dev = runner.device
    sizes = [seqs[i].drafts + 1 for i in sampled]
    first = np.cumsum([0] + sizes[:-1])
    plain = [j for j, i in enumerate(sampled) if not seqs[i].drafts]
    spec = [j for j, i in enumerate(sampled) if seqs[i].drafts]
    tokens = torch.empty(len(sampled), dtype=torch.int64, device=dev)
    accepted = torch.zeros(len(sampled), dtype=torch.int64, device=dev)
    logprobs = None
    if plain:
        ps = [seqs[sampled[j]] for j in plain]
        slots = [s.slot for s in ps]
        got, lp = runner.sampler.sample(logits[upload(first[plain], torch.int64, dev)], slots,
                                        upload(slots, torch.int64, dev),
                                        [s.start_pos + len(s.tokens) - 1 for s in ps], [s.allowed for s in ps])
        at = upload(plain, torch.int64, dev)
        tokens[at] = got
        if lp is not None:  # rows for every sampled seq: those with drafts ask for none
            logprobs = tuple(torch.zeros((len(sampled), *t.shape[1:]), dtype=t.dtype, device=dev).index_copy_(0, at, t)
                             for t in lp)
    ds = [seqs[sampled[j]] for j in spec]
    rows = np.concatenate([np.arange(first[j], first[j] + sizes[j]) for j in spec])
    got, count = runner.sampler.verify(logits[upload(rows, torch.int64, dev)], [s.slot for s in ds],
                                       [list(s.tokens[len(s.tokens) - s.drafts:]) for s in ds])
    at = upload(spec, torch.int64, dev)
    tokens[at], accepted[at] = got, count
    return tokens, accepted, logprobs
