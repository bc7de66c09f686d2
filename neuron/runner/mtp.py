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
sampling temperature too (``sampler.verify``: one-hot drafts). The rows run eagerly; the
guesses stay on the device until the last pass, then come to the host in one copy."""

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
        heads = [i for i, k in enumerate(want) if k]
        out, rows, drawn_t = self._run(r, spans, h_in, heads)
        if not heads:
            return proposals
        # The chain: each pass a row for every seq still guessing, on its last guess (still on
        # the device: one copy to the host at the end) and the layer's output after it.
        seq_of = [of_seq[i] for i in heads]
        wanted = [want[i] for i in heads]
        slot_of = [spans[i].slot for i in heads]
        pos = [spans[i].start_pos + len(spans[i].tokens) for i in heads]
        made = [1] * len(heads)
        passes = [(list(range(len(heads))), drawn_t)]  # (chain members, their guesses)
        at = list(range(len(heads)))  # each member's index in the previous pass
        while True:
            going = [m for m in passes[-1][0] if made[m] < wanted[m]
                     and pos[m] < min(r.assigned[slot_of[m]] * r.bs, r.cfg.max_len)]
            if not going:
                break
            prev = upload([at[m] for m in going], torch.int64, r.device)
            steps = [p.StepSeq(slot=slot_of[m], tokens=[0], start_pos=pos[m], sample=True) for m in going]
            out, rows, drawn_t = self._run(r, steps, out[upload([rows[at[m]] for m in going], torch.int64, r.device)],
                                           list(range(len(going))), ids=passes[-1][1][prev])
            for n, m in enumerate(going):
                at[m], made[m], pos[m] = n, made[m] + 1, pos[m] + 1
            passes.append((going, drawn_t))
        values = iter(torch.cat([g for _, g in passes]).tolist())
        for members, _ in passes:
            for m in members:
                proposals[seq_of[m]].append(next(values))
        return proposals

    @staticmethod
    def _run(r, spans: list[p.StepSeq], hidden: torch.Tensor, guess: list[int], ids: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """The layer over ``spans`` (``ids``: their tokens on the device, for the spans' own):
        its outputs, and the last row of each span in ``guess`` with its argmax (on the device)."""
        flat, positions, _, meta, ends, _ = eager_inputs(r, spans, states=False)
        r.attention.meta = meta
        last = [ends[i] for i in guess] or ends[-1:]
        out, logits = r.model.mtp_forward(flat if ids is None else ids, positions, hidden, r.attention,
                                          upload(last, torch.int64, r.device))
        return out, last, logits.argmax(-1)
