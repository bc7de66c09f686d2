"""Speculative decoding on the leader: prompt-lookup (n-gram) drafts and when to send them.

A sequence's drafts are what followed the most recent earlier occurrence of its last few tokens
(the longest of ``MAX_N`` down to ``MIN_N`` that occurred before), in its prompt or its output:
free to make, and right where an answer repeats its context (edits, code, quotes, retrieval).
The rank checks them in one step (``StepSeq.drafts``, ``runner/speculative``) and keeps those
its own draws confirm, so the output is the model's own either way; a wrong draft costs the
step the rows it added.

So drafting adapts, per sequence: the drafts a step may carry grow by one after a step that
accepted all of them, shrink to one more than the accepted run after a step that accepted some,
and by one after a step that accepted none; at none, the sequence
stops drafting for a number of steps that doubles with each such stop (``MAX_PAUSE`` at most),
and a sequence whose last tokens occurred nowhere before pauses a few steps. While it drafts, a
sequence's decode waits for its input token (the lookup needs it), where it would otherwise go
out in the step planned before that token is known (overlapped steps); paused, it overlaps. And
a step drafts only while it decodes few sequences (``MAX_DECODES``): a batch of decodes already
reads each weight once for many tokens, so extra rows there cost more than they save.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import Sampling

MAX_N = 4
MIN_N = 2
MAX_PAUSE = 64
NO_MATCH_PAUSE = 4
# Decodes a step may carry and still draft. On the 2-core CPU of this repository's CI machines
# one step of the default model took 9.0 / 11.6 / 14.8 / 23.1 ms for 1 / 2 / 4 / 8 rows
# (scripts/profile-step SmolLM2-135M-Instruct --device cpu --dtype float32 --batch 1,2,4,8).
MAX_DECODES = 4


def may_draft(p: Sampling, constrained: bool, images: list | tuple = ()) -> bool:
    """Whether a request's draws can be checked in a batch of drafts: not with a grammar,
    penalties, logprobs, a seed, biases or min_tokens, which the rank applies token by token, nor
    with images (their M-RoPE positions are not checked with drafts yet): a request with any of
    them decodes as without speculation."""
    return not (constrained or images or p.logprobs or p.seed is not None or p.logit_bias or p.min_tokens
                or p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty)


class NgramIndex:
    """Where each n-gram of a growing token list last occurred, for ``MIN_N <= n <= MAX_N``:
    indexed as tokens come (a long prompt once), looked up in constant time."""

    def __init__(self) -> None:
        self.last: dict[tuple[int, ...], int] = {}  # gram -> the index of the token after it
        self.seen = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest n-gram
        ``tokens`` ends with; [] where none occurred before."""
        L = len(tokens)
        for end in range(max(self.seen, MIN_N), L):  # grams with a token after them
            for n in range(MIN_N, min(MAX_N, end) + 1):
                self.last[tuple(tokens[end - n: end])] = end
        self.seen = max(self.seen, L)
        for n in range(min(MAX_N, L), MIN_N - 1, -1):
            at = self.last.get(tuple(tokens[L - n:]))
            if at is not None:
                return tokens[at: at + k]
        return []


@dataclass
class Speculation:
    """One request's drafting: its index, the drafts a step may carry now, and its pause."""

    most: int  # the model's ``speculative.tokens``
    index: NgramIndex = field(default_factory=NgramIndex)
    width: int = 0  # drafts the next step may carry (0: set to ``most`` at the first)
    pause: int = 0  # steps left without drafts
    stops: int = 0  # pauses so far in a row
    drafted: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        self.width = self.most

    @property
    def active(self) -> bool:
        """Drafting now: its decodes wait for their input token (a draft follows it), instead of
        going out before it is known (overlapped steps)."""
        return not self.pause

    def tick(self) -> bool:
        """A decode is planned: whether it may draft (a paused sequence counts its pause down)."""
        if self.pause:
            self.pause -= 1
            return False
        return True

    def drafts(self, tokens: list[int], room: int) -> list[int]:
        """The drafts for the next step of a sequence of ``tokens``, at most ``room``; where
        none matches, the sequence pauses ``NO_MATCH_PAUSE`` steps (and overlaps them)."""
        found = self.index.propose(tokens, min(self.width, room)) if room > 0 else []
        if not found:
            self.pause = NO_MATCH_PAUSE
        return found

    def checked(self, drafted: int, accepted: int) -> None:
        """A step's verdict on ``drafted`` drafts: ``accepted`` of them held."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.width = min(self.most, self.width + 1)
            self.stops = 0
        elif accepted:  # a run of this length held: guess one more than it next time
            self.width = min(self.width, accepted + 1)
        else:
            self.width -= 1
            if self.width == 0:
                self.pause = min(MAX_PAUSE, 2 << self.stops)
                self.stops += 1
                self.width = 1
