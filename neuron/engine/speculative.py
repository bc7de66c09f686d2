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
and a sequence whose last tokens occurred nowhere before pauses a few steps (pauses end at
multiples of their length, together). While a sequence drafts, the next step waits for its input
token (the lookup needs it), where it would otherwise go out planned before that token is known
(overlapped steps), and with it the whole batch; paused, it overlaps. And a step drafts only
while it decodes few sequences (``DraftPolicy.decodes``) and carries few rows: a batch of decodes
already reads each weight once for many tokens, so extra rows there cost more than they save.

``mtp`` drafts with the checkpoint's multi-token-prediction layer, on the rank: a step of a
drafting sequence asks for proposals (``StepSeq.propose``), which come back with its token
(``StepResult.proposals``) and go out as the next step's drafts; a step without them only asks.

Two more drafters exist to measure the mechanism (random weights accept almost nothing):
``replay`` proposes a recorded answer to the same prompt (every draft right, where the model is
deterministic), ``random`` proposes random tokens (every draft wrong).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from protocol import Sampling

MAX_N = 4
MIN_N = 2
MAX_PAUSE = 64
NO_MATCH_PAUSE = 4
# Decodes a step may carry and still draft. On the 2-core CPU of this repository's CI machines
# one step of the default model took 9.0 / 11.6 / 14.8 / 23.1 ms for 1 / 2 / 4 / 8 rows
# (scripts/profile-step SmolLM2-135M-Instruct --device cpu --dtype float32 --batch 1,2,4,8).
MAX_DECODES = 4
# On a GPU a step of up to 64 rows reads each weight once at about one row's time (the decode
# graphs' products are bandwidth-bound there), so more decodes may draft.
GPU_DECODES = 16
GPU_ROWS = 64
# On a GPU each draft's row reads its sequence's K/V once more (a decode graph's row attends on
# its own): the drafts a decode carries are cut so those reads stay within this share of the
# weight bytes a step reads (DraftPolicy.room).
LONG_CONTEXT_SHARE = 0.25


class DraftError(ValueError):
    """A drafter's settings cannot be used (a replay file that cannot be read)."""


@dataclass
class DraftPolicy:
    """A model's speculative decoding on the leader: the drafter, the drafts a decode may carry,
    and the steps that may carry them (at most ``decodes`` decodes and ``rows`` rows)."""

    method: str  # ngram | mtp | replay | random
    tokens: int
    decodes: int
    rows: int
    vocab: int = 0
    replay: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    # On a GPU, set at load: the K/V bytes a row's attention reads per token of its context, over
    # the weight bytes a step reads (a rank's); 0: no limit by context.
    context_cost: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    @classmethod
    def build(cls, method: str, tokens: int, gpu: bool, vocab: int, slots: int, replay: str = "") -> "DraftPolicy":
        decodes, rows = (GPU_DECODES, max(GPU_ROWS, tokens + 1)) if gpu else (MAX_DECODES, MAX_DECODES * (tokens + 1))
        policy = cls(method, tokens, min(decodes, slots), min(rows, slots * (tokens + 1)), vocab)
        if method == "replay":
            policy.replay = read_replay(Path(replay), vocab)
        return policy

    def room(self, context: int) -> int:
        """The drafts a decode at ``context`` tokens may carry: fewer as its K/V grows, none once
        a draft's row would read more than ``LONG_CONTEXT_SHARE`` of a step's weight bytes."""
        if not self.context_cost:
            return self.tokens
        return min(self.tokens, int(LONG_CONTEXT_SHARE / (max(1, context) * self.context_cost)))

    def drafter(self, prompt: list[int]):
        """A request's drafter, or None where the method has nothing to propose for it."""
        if self.method == "ngram":
            return NgramIndex()
        if self.method == "random":
            return RandomDrafter(self.vocab, self.rng)
        if self.method == "mtp":
            return MtpProposals()
        answer = self.replay.get(tuple(prompt))
        return None if answer is None else Replay(len(prompt), answer)

    def answered(self, prompt: list[int], output: list[int]) -> None:
        """A request that drafted finished: ``replay`` proposes its answer to the next request
        of the same prompt (the answer as this server's steps with drafts compute it: on a GPU
        a batch's shape can change a greedy token, so a record made without drafts may part
        from it)."""
        if self.method == "replay" and tuple(prompt) in self.replay:
            self.replay[tuple(prompt)] = list(output)


def read_replay(path: Path, vocab: int) -> dict[tuple[int, ...], list[int]]:
    """A replay file: JSON lines of ``{"prompt": [ids], "output": [ids]}``, every id in the
    vocabulary (the rank refuses a step with any other)."""
    out: dict[tuple[int, ...], list[int]] = {}
    try:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt, output = row["prompt"], row["output"]
            if not all(type(t) is int and 0 <= t < vocab for t in prompt + output):
                raise ValueError(f"line {n}: token ids must be integers in 0..{vocab - 1}")
            out[tuple(prompt)] = output
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise DraftError(f"replay file {str(path)!r}: {exc}") from None
    return out


class Replay:
    """Proposes a recorded answer to the request's prompt, from the position the output is at,
    while the output is the record's (after a token of its own, nothing)."""

    def __init__(self, prompt_len: int, answer: list[int]) -> None:
        self.prompt_len, self.answer = prompt_len, answer
        self.seen = 0  # output tokens compared with the record so far
        self.diverged = False

    def may_match(self, prompt: list[int], output: list[int]) -> bool:
        return not self.diverged and len(output) < len(self.answer)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        at = len(tokens) - self.prompt_len
        if self.diverged or tokens[self.prompt_len + self.seen:] != self.answer[self.seen: at]:
            self.diverged = True
            return []
        self.seen = at
        return self.answer[at: at + k]


class MtpProposals:
    """The drafts the rank's MTP layer proposed to follow a sequence's tokens so far
    (``StepResult.proposals``); where none came for the tokens as they are, the step asks for
    them (``StepSeq.propose``) and drafts the next, so a miss is no reason to pause."""

    pauses = False

    def __init__(self) -> None:
        self.at, self.tokens = -1, []

    def offer(self, at: int, tokens: list[int]) -> None:
        """Proposals to follow the sequence's first ``at`` tokens."""
        self.at, self.tokens = at, tokens

    def may_match(self, prompt: list[int], output: list[int]) -> bool:
        return True

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return self.tokens[:k] if self.at == len(tokens) else []


class RandomDrafter:
    """Proposes tokens drawn uniformly from the vocabulary."""

    def __init__(self, vocab: int, rng: random.Random) -> None:
        self.vocab, self.rng = vocab, rng

    def may_match(self, prompt: list[int], output: list[int]) -> bool:
        return True

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(k)]


def may_draft(p: Sampling, constrained: bool) -> bool:
    """Whether a request's draws can be checked in a batch of drafts: not with a grammar,
    penalties, logprobs, a seed, biases or min_tokens, which the rank applies token by token: a
    request with any of them decodes as without speculation."""
    return not (constrained or p.logprobs or p.seed is not None or p.logit_bias or p.min_tokens
                or p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty)


class NgramIndex:
    """Where each n-gram of a growing token list last occurred, for ``MIN_N <= n <= MAX_N``:
    indexed as tokens come (a long prompt once), looked up in constant time."""

    def __init__(self) -> None:
        self.last: dict[tuple[int, ...], int] = {}  # gram -> the index of the token after it
        self.seen = 0
        self.before: set[int] = set()  # the tokens but the last two (see may_match)
        self.counted = 0

    def may_match(self, prompt: list[int], output: list[int]) -> bool:
        """Whether the next proposal can find anything, before the next token is known: a
        gram ending in that token has a token after it only where the last known token occurred
        before, ahead of two more."""
        L = len(prompt) + len(output)
        for i in range(self.counted, L - 1):
            self.before.add(prompt[i] if i < len(prompt) else output[i - len(prompt)])
        self.counted = max(self.counted, L - 1)
        last = output[-1] if output else prompt[-1]
        return last in self.before

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
    """One request's drafting: its drafter, the drafts a step may carry now, and its pause.

    Time is the scheduler's count of steps (``clock``). A pause of ``n`` steps ends at the next
    multiple of ``n``, so that sequences paused alike draft again in the same steps: a step
    with drafts waits for its sequences' input tokens (no overlap), and that is paid once for
    all of them, not once for each."""

    most: int  # the model's ``speculative.tokens``
    index: NgramIndex | Replay | RandomDrafter | MtpProposals = field(default_factory=NgramIndex)
    width: int = 0  # drafts the next step may carry (0: set to ``most`` at the first)
    resume: int = 0  # the step from which it drafts again
    stops: int = 0  # pauses so far in a row
    drafted: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        self.width = self.most

    def active(self, clock: int) -> bool:
        """Not paused: a decode whose input token is known may draft."""
        return clock >= self.resume

    def waits(self, clock: int, prompt: list[int], output: list[int]) -> bool:
        """Its next decode waits for its input token (drafts may follow it), instead of going
        out before it is known (overlapped steps): unpaused, and with drafts in sight."""
        return clock >= self.resume and self.index.may_match(prompt, output)

    def drafts(self, tokens: list[int], room: int, clock: int) -> list[int]:
        """The drafts for the next step of a sequence of ``tokens``, at most ``room``; where
        none matches, the sequence pauses up to ``NO_MATCH_PAUSE`` steps (and overlaps them)."""
        found = self.index.propose(tokens, min(self.width, room)) if room > 0 else []
        if not found and getattr(self.index, "pauses", True):
            self.pause(clock, NO_MATCH_PAUSE)
        return found

    def pause(self, clock: int, steps: int) -> None:
        self.resume = (clock // steps + 1) * steps

    def checked(self, drafted: int, accepted: int, clock: int) -> None:
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
                self.pause(clock, min(MAX_PAUSE, 2 << self.stops))
                self.stops += 1
                self.width = 1
