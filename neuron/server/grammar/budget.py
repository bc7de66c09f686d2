"""Ending a constrained output within its token budget.

A grammar alone does not make generation end: a model that wants nothing of the grammar (random
weights, or a real model that rambles) can stay inside a JSON string until ``max_tokens`` cuts it,
and the client gets JSON that does not parse. So a grammar constraint keeps its *gap* in view:
tokens left minus the length of the shortest way from here to an output the grammar accepts.

- While the gap is wide, nothing changes.
- In the window (gap <= shortest + MARGIN), tokens that may open something ('{', '[', ',', '"') are tried
  on a copy of the parser and kept only if the gap stays open after them; within CALM_GAP, also no
  half UTF-8 characters or escapes (each lengthens the way out).
- At SLACK the output takes the shortest way's own path, token by token, and ends.
- Where the output may end, a way on that could not end within the budget (another tool call
  with too few tokens left for it) is closed: the output ends there instead.

The shortest way is found greedily over token classes (``VocabTables``): forced text whole, then
closers, separators, plain text. It is an estimate of one fixed policy, and that same policy
writes the ending, so the estimate is what the ending costs. A way found is kept: while it still
ends the output from where the output has got to (one ``validate_tokens`` call), it is the
estimate and the ending, and no search runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import llguidance as llg
import numpy as np

_CLOSERS = frozenset(b'"]}')
_OPENERS = frozenset(b"{[,")
_RISKY = frozenset(b'{[,"')
_PUNCTUATION = frozenset(b'"]},:')
_WHITESPACE = frozenset(b" \t\r\n")
_CONTINUATION = bytes(range(0x80, 0xC0))

# Re-estimate the shortest way at least this often, and every step in the window. An estimate
# looks LOOKAHEAD tokens ahead at most: beyond it, it is a lower bound. Sequences take turns:
# each starts at its own phase of the cycle (from its prompt: the same request gives the same
# output in any process), so streams that start together do not all re-estimate in the same
# step (64 JSON streams made every eighth step 22 ms longer).
RECHECK_EVERY = 8
MARGIN = 16
LOOKAHEAD = 128
# A calm token lengthens the shortest way by two at most, so calm tokens from CALM_GAP on keep
# the gap from jumping past SLACK in one step. Opening tokens are tried one by one, TRY_AT_MOST
# of them (more only happens inside a string, where they are text and can wait).
SLACK = 3
CALM_GAP = 8
TRY_AT_MOST = 12


def pack(ids: list[int] | np.ndarray, vocab: int) -> np.ndarray:
    """Token ids as a mask: ceil(vocab / 32) little-endian uint32 words, bit t = token t."""
    bits = np.zeros(((vocab + 31) // 32) * 32, dtype=bool)
    bits[np.asarray(ids, dtype=np.int64)] = True
    return np.packbits(bits, bitorder="little").view("<u4").copy()


def unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def _opens_character(data: bytes) -> bool:
    """Whether ``data`` ends inside a UTF-8 character (leading continuation bytes finish one)."""
    try:
        data.lstrip(_CONTINUATION).decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.reason == "unexpected end of data"
    return False


@dataclass
class VocabTables:
    """Token classes of one tokenizer. ``tiers``, best first, each with a score ranking its tokens;
    whatever the grammar allows next, the first tier holding some of it has the tokens that end
    the output soonest:

    1. closers starting with '"' ('"', '"]}'): inside a string they end it (other closers would
       only be more string), elsewhere a '"' starts the shortest value or key;
    2. the other closers (']', '}]'): end arrays and objects;
    3. punctuation (',', ':', '",'): the separator that a required key or a number's end needs;
    4. plain text: a forced key or enum value spelled out, a number's first digit;
    5. anything but whitespace: a '{' or '[' the schema demands.
    """

    vocab: int
    eos: list[int]
    tiers: list[tuple[np.ndarray, np.ndarray]]  # (member of the tier [vocab] bool, score [vocab])
    risky: np.ndarray  # packed: tokens with '{', '[', ',' or '"'
    calm: np.ndarray  # packed: tokens without '\' that leave no UTF-8 character open
    letter: int | None  # a one-letter token that JSON allows only inside strings ('x', 'q', ...)
    eos_mask: np.ndarray = field(init=False)
    preferred: list[int] = field(init=False)
    preferred_outside_text: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.eos_mask = pack([t for t in self.eos if t < self.vocab], self.vocab)
        # Closers and punctuation, best first: few enough to try one by one without a mask.
        quoted, closers, punctuation = ([int(t) for t in sorted(np.flatnonzero(members), key=lambda t: -score[t])]
                                        for members, score in self.tiers[:3])
        self.preferred = quoted + closers + punctuation
        self.preferred_outside_text = closers + quoted + punctuation

    def words(self, bitmask: bytes) -> np.ndarray:
        """llguidance's mask cut to ceil(vocab / 32) words (it keeps a spare word)."""
        return np.frombuffer(bitmask, dtype="<u4")[: (self.vocab + 31) // 32]

    def closing_token(self, matcher: llg.LLMatcher) -> int | None:
        """The next token of the shortest way (None: it is complete, EOS is next)."""
        if matcher.is_accepting():
            return None
        forced = matcher.compute_ff_tokens()
        if forced:
            return forced[0]
        # Inside a string a '"' ends it; elsewhere a ']' or '}' may end more than a '"' starts.
        in_text = self.letter is None or matcher.validate_tokens([self.letter]) == 1
        preferred = self.preferred if in_text else self.preferred_outside_text
        token = next((t for t in preferred if matcher.validate_tokens([t]) == 1), None)
        if token is None:
            token = self._best(self.words(matcher.compute_bitmask()))
        return None if token in self.eos else token

    def _best(self, mask: np.ndarray) -> int | None:
        allowed = unpack(mask, self.vocab)
        for members, score in self.tiers:
            inside = np.flatnonzero(allowed & members)
            if inside.size:
                return int(inside[np.argmax(score[inside])])
        ids = np.flatnonzero(allowed)
        return int(ids[0]) if ids.size else None


def build_tables(tokenizer: llg.LLTokenizer, vocab: int, eos: list[int]) -> VocabTables:
    quoted, closers, punctuation, plain, visible, risky, calm = (np.zeros(vocab, dtype=bool) for _ in range(7))
    length = np.zeros(vocab, dtype=np.int32)
    letter = None
    for t in range(min(vocab, tokenizer.vocab_size)):
        if tokenizer.is_special_token(t):
            continue
        data = tokenizer.decode_bytes([t])
        if not data:
            continue
        chars = set(data)
        if data in (b"x", b"q", b"z", b"k", b"w") and letter is None:
            letter = t
        length[t] = len(data)
        risky[t] = bool(chars & _RISKY)
        calm[t] = b"\\" not in data and not _opens_character(data)
        if chars <= _CLOSERS:
            quoted[t] = data[:1] == b'"'
            closers[t] = not quoted[t]
        else:
            punctuation[t] = chars <= _PUNCTUATION
            plain[t] = not punctuation[t] and not chars & _OPENERS and not chars <= _WHITESPACE
            visible[t] = not chars <= _WHITESPACE
    tiers = [(quoted, length), (closers, length), (punctuation, length), (plain, length), (visible, length)]
    return VocabTables(vocab, eos, tiers, pack(np.flatnonzero(risky), vocab), pack(np.flatnonzero(calm), vocab),
                       letter)


def shortest_path(matcher: llg.LLMatcher, tables: VocabTables, limit: int) -> list[int] | None:
    """The tokens the closing policy takes from ``matcher``'s state to an output the grammar
    accepts (EOS not included), or None when it finds no end within ``limit`` (and LOOKAHEAD)
    tokens: a grammar it cannot steer (an unbounded regex), or too far to tell. Forced text is
    taken whole and preferred tokens are tried before any full mask, so this costs far less than
    a mask per token."""
    probe = matcher.deep_copy()
    path: list[int] = []
    while len(path) <= min(limit, LOOKAHEAD):
        if probe.is_accepting():
            return path
        forced = probe.compute_ff_tokens()
        if forced:
            if not probe.consume_tokens(forced):
                return None
            path += forced
            continue
        token = tables.closing_token(probe)
        if token is None or not probe.consume_token(token):
            return None
        path.append(token)
    return None


def shortest_completion(matcher: llg.LLMatcher, tables: VocabTables, limit: int) -> int | None:
    """The length of ``shortest_path``."""
    path = shortest_path(matcher, tables, limit)
    return None if path is None else len(path)


class Budget:
    """The budget policy of one constrained sequence (see the module docstring). Where the
    closing policy finds no end (``cost`` None), it leaves the grammar's mask alone."""

    def __init__(self, tables: VocabTables, max_tokens: int, phase: int = 0) -> None:
        self.tables = tables
        self.remaining = max_tokens  # tokens still to be drawn, the next one included
        self.closing = False  # the output is on the shortest way to its end
        self.cost: int | None = None
        self._checked = False
        self._since_check = phase % RECHECK_EVERY  # counts on from here after the first check
        # The way out found at the last estimate. While it still ends the output (a check of a
        # microsecond, where finding it took tens: inside a JSON string it holds for as long as
        # the string runs), the estimate is its length, and the ending follows it.
        self.path: list[int] | None = None
        self._end = next((t for t in tables.eos if t < tables.vocab), None)

    def took(self, token: int) -> None:
        """``token`` was drawn: the way out goes on from its next token if it was the first."""
        if self.path and self.path[0] == token:
            self.path = self.path[1:]

    def _path_holds(self, matcher: llg.LLMatcher, token: int | None = None) -> bool:
        """Whether the way out still ends the output from here (after ``token``, if given)."""
        if self.path is None or self._end is None:
            return False
        tokens = ([] if token is None else [token]) + self.path + [self._end]
        return matcher.validate_tokens(tokens) == len(tokens)

    def mask(self, matcher: llg.LLMatcher) -> np.ndarray:
        """The mask for the next token: the grammar's, narrowed as the gap requires."""
        left = self.remaining
        gap = None
        if not self.closing:
            cost = self._shortest(matcher, left)
            gap = None if cost is None else left - cost
            self.closing = gap is not None and gap <= SLACK
        if self.closing:
            if self._path_holds(matcher):
                token = self.path[0] if self.path else None
            else:
                token = self.tables.closing_token(matcher)
            return self.tables.eos_mask if token is None else pack([token], self.tables.vocab)
        mask = self.tables.words(matcher.compute_bitmask())
        if matcher.is_accepting():
            return self._without_dead_ends(matcher, mask, left)
        if gap is not None and self.cost is not None and gap <= self.cost + MARGIN:
            mask = self._without_jumps(matcher, mask, left, gap)
        return mask

    def _without_dead_ends(self, matcher: llg.LLMatcher, mask: np.ndarray, left: int) -> np.ndarray:
        """At a point where the output may end, the few ways on (another tool call, another
        item of a repetition) that could not end within the budget: an output that took one
        would be cut off unfinished, so the output ends here instead."""
        going_on = mask & ~self.tables.eos_mask
        ids = np.flatnonzero(unpack(going_on, self.tables.vocab))
        if not ids.size or len(ids) > TRY_AT_MOST:
            return mask
        dead = []
        for t in ids.tolist():
            probe = matcher.deep_copy()
            after = shortest_completion(probe, self.tables, left - 1) if probe.consume_token(t) else None
            if after is None or left - 1 - after < SLACK:
                dead.append(t)
        return mask & ~pack(dead, self.tables.vocab) if dead else mask

    def _shortest(self, matcher: llg.LLMatcher, left: int) -> int | None:
        if self._path_holds(matcher):  # a check at any turn: the sequence keeps its phase
            self.cost = len(self.path)
            self._since_check = 0 if self._since_check >= RECHECK_EVERY else self._since_check + 1
            return self.cost
        near = self.cost is not None and left <= 2 * self.cost + MARGIN
        if not self._checked or self._since_check >= RECHECK_EVERY or near:
            self.path = shortest_path(matcher, self.tables, left)
            self.cost = None if self.path is None else len(self.path)
            if self._checked:  # the first check keeps the sequence's phase
                self._since_check = 0
            self._checked = True
        else:
            self._since_check += 1
        return self.cost

    def _without_jumps(self, matcher: llg.LLMatcher, mask: np.ndarray, left: int, gap: int) -> np.ndarray:
        risky = mask & self.tables.risky
        keep: list[int] = []
        if risky.any():
            ids = np.flatnonzero(unpack(risky, self.tables.vocab))
            if len(ids) <= TRY_AT_MOST:
                holds = self._path_holds(matcher)
                for t in ids.tolist():
                    # No probe where the way out goes on after the token (it opens nothing), or
                    # starts with it: a way of that length is known.
                    known = len(self.path) - 1 if holds and self.path and t == self.path[0] else \
                        len(self.path) if self._path_holds(matcher, t) else None
                    if known is not None and left - 1 - known >= 2:
                        keep.append(t)
                        continue
                    probe = matcher.deep_copy()
                    if not probe.consume_token(t):
                        continue
                    after = shortest_completion(probe, self.tables, left)
                    if after is not None and left - 1 - after >= 2:
                        keep.append(t)
        narrowed = (mask & ~self.tables.risky) | pack(keep, self.tables.vocab)
        if gap <= CALM_GAP:
            narrowed &= self.tables.calm
        return narrowed if narrowed.any() else mask
