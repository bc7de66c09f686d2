"""Drafts from the model's MTP layer, on the rank (``StepSeq.propose``, ``models.mtp``).

After a step has drawn its tokens (and checked its drafts), the MTP layer runs over each
proposing seq's rows that stand: row ``i`` takes the step's final hidden state ``h_i`` and the
token after it, which is the next row's input, or for the last row the token just drawn. That
fills the layer's own K/V at the positions it has not seen, and its last row guesses the token
after the draw. Each further guess is one more row of the layer, at the next position, on the
previous guess and the layer's own output there. Those rows store their K/V at positions the
sequence's next step writes over; the leader holds blocks for them, and a guess stops where the
sequence's block table ends.

A prompt chunk that draws nothing cannot run its last row (the token after it is the next
chunk's first): its hidden state waits in a per-slot carry for the next chunk. A decode that
proposes nothing leaves the layer's K/V at its position stale: later guesses attend to it, so
they are a little worse, never wrong (the step that checks them decides).

The guesses are greedy (the layer's argmax); the check keeps the target distribution with a
sampling temperature too (``sampler.verify``: one-hot drafts). Each chained row costs a sync to
learn the previous guess, and runs eagerly."""

from __future__ import annotations

import weakref

import torch

import protocol as p

from .eager import eager_inputs
from .sampler import upload


class MtpDrafting:
    def __init__(self, runner) -> None:
        self._runner = weakref.ref(runner)  # the runner holds this
        cfg, model = runner.cfg, runner.model
        self.carry = torch.zeros(cfg.max_seqs, model.cfg.hidden_size, dtype=model.dtype, device=runner.device)
        self.carry_at = [-1] * cfg.max_seqs  # the position whose hidden state waits in carry; -1: none

    def after_step(self, seqs: list[p.StepSeq], ids: torch.Tensor, tokens: torch.Tensor,
                   accepted: torch.Tensor | None) -> list[list[int]]:
        """The proposals of each seq of a step that ran (``ids``: its resolved input rows;
        ``tokens``, ``accepted``: each sampled seq's draw and drafts kept)."""
        r = self._runner()
        hidden = r.model.hidden
        drawn = tokens.tolist()
        kept = accepted.tolist() if accepted is not None else [0] * len(drawn)
        rows_in = ids.tolist()
        T = sum(len(s.tokens) for s in seqs)
        spans: list[p.StepSeq] = []
        want: list[int] = []  # per span: the guesses its seq asked for (0: fill the cache only)
        of_seq: list[int] = []
        sources: list[int] = []  # each span row's hidden state: a step row, or T + a carry slot
        carries: list[tuple[int, int, int]] = []  # (slot, step row, position) to carry
        off = j = 0
        for i, s in enumerate(seqs):
            n = len(s.tokens)
            if s.sampling is not None:
                self.carry_at[s.slot] = -1
            if s.propose:
                if s.sample:
                    valid = n - s.drafts + (kept[j] if s.drafts else 0)
                    toks, rows = rows_in[off + 1: off + valid] + [drawn[j]], list(range(off, off + valid))
                else:
                    toks, rows = rows_in[off + 1: off + n], list(range(off, off + n - 1))
                    carries.append((s.slot, off + n - 1, s.start_pos + n - 1))
                start = s.start_pos
                if 0 <= self.carry_at[s.slot] == start - 1:
                    toks, rows, start = [rows_in[off]] + toks, [T + s.slot] + rows, start - 1
                self.carry_at[s.slot] = -1
                if toks:
                    spans.append(p.StepSeq(slot=s.slot, tokens=toks, start_pos=start, sample=True))
                    want.append(s.propose if s.sample else 0)
                    of_seq.append(i)
                    sources += rows
            j += s.sample
            off += n
        proposals: list[list[int]] = [[] for _ in seqs]
        if not spans:
            return proposals
        h_in = torch.cat([hidden[:T], self.carry]).index_select(0, upload(sources, torch.int64, r.device))
        for slot, row, at in carries:
            self.carry[slot] = hidden[row]
            self.carry_at[slot] = at
        out, guesses = self._run(r, spans, h_in, [k > 0 for k in want])
        chain = []  # (seq index, slot, next position, guesses wanted, the output row to chain on)
        found = iter(guesses)
        for at, k, s in zip(of_seq, want, spans):
            if k:
                row, g = next(found)
                proposals[at].append(g)
                chain.append((at, s.slot, s.start_pos + len(s.tokens), k, row))
        while True:
            chain = [c for c in chain if len(proposals[c[0]]) < c[3] and c[2] < min(r.assigned[c[1]] * r.bs,
                                                                                         r.cfg.max_len)]
            if not chain:
                return proposals
            steps = [p.StepSeq(slot=slot, tokens=[proposals[at][-1]], start_pos=pos, sample=True)
                     for at, slot, pos, _, _ in chain]
            out, guesses = self._run(r, steps, out[upload([c[4] for c in chain], torch.int64, r.device)],
                                     [True] * len(steps))
            for n, ((at, slot, pos, k, _), (row, g)) in enumerate(zip(chain, guesses)):
                proposals[at].append(g)
                chain[n] = (at, slot, pos + 1, k, row)

    @staticmethod
    def _run(r, spans: list[p.StepSeq], hidden: torch.Tensor, guess: list[bool]
             ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The layer over ``spans``: its outputs, and (last row, argmax) of each span in ``guess``."""
        ids, positions, _, meta, ends, _ = eager_inputs(r, spans, states=False)
        r.attention.meta = meta
        last = [e for e, g in zip(ends, guess) if g] or ends[-1:]
        out, logits = r.model.mtp_forward(ids, positions, hidden, r.attention, upload(last, torch.int64, r.device))
        if not any(guess):
            return out, []
        return out, list(zip(last, logits.argmax(-1).tolist()))
