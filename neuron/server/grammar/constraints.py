"""Token constraints besides grammars: a fixed set of allowed tokens (``allowed_token_ids``),
banned words (``bad_words``), a constraint that starts after a marker (structured output after a
reasoning model's thinking), a budget of thinking tokens, and several at once. Each is a ``TokenConstraint``: the engine asks
``allowed`` before a sampling step and reports the drawn token with ``accept``."""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from .budget import pack


class Constraint(Protocol):
    def allowed(self) -> bytes | None: ...

    def accept(self, token: int) -> None: ...


class AllowedTokens:
    """Only these tokens, ever."""

    def __init__(self, ids: list[int], vocab: int) -> None:
        self.mask = pack(ids, vocab).tobytes()

    def allowed(self) -> bytes:
        return self.mask

    def accept(self, token: int) -> None:
        pass


class BannedSequences:
    """vLLM's ``bad_words``: a word's last token is banned whenever the tokens before it were just
    generated (a one-token word is banned always)."""

    def __init__(self, sequences: list[list[int]], vocab: int) -> None:
        self.sequences = [s for s in sequences if s and all(0 <= t < vocab for t in s)]
        self.vocab = vocab
        self.output: list[int] = []
        self.everything = pack(np.arange(vocab), vocab)

    def allowed(self) -> bytes | None:
        banned = [s[-1] for s in self.sequences if len(s) == 1 or self.output[-(len(s) - 1):] == s[:-1]]
        if not banned:
            return None
        return (self.everything & ~pack(banned, self.vocab)).tobytes()

    def accept(self, token: int) -> None:
        self.output.append(token)


class AfterMarker:
    """``inner`` applies only once the output contains ``marker`` (e.g. a JSON schema after
    ``</think>``); tokens before it still spend ``inner``'s budget."""

    def __init__(self, inner: Constraint, marker: bytes, token_bytes: Callable[[int], bytes]) -> None:
        self.inner = inner
        self.marker = marker
        self.token_bytes = token_bytes
        self.tail = b""
        self.active = False

    def allowed(self) -> bytes | None:
        return self.inner.allowed() if self.active else None

    def accept(self, token: int) -> None:
        if self.active:
            self.inner.accept(token)
            return
        spend = getattr(self.inner, "spend", None)
        if spend is not None:
            spend()
        self.tail = (self.tail + self.token_bytes(token))[-(len(self.marker) + 64):]
        self.active = self.marker in self.tail

    @property
    def closed_early(self) -> bool:
        return bool(getattr(self.inner, "closed_early", False))


class ThinkingBudget:
    """At most ``budget`` tokens of thinking: once they are spent, the end marker's tokens are
    forced one by one and the answer follows (vLLM's ``thinking_token_budget``, Anthropic's
    ``budget_tokens``). ``thinking`` says where the prompt left the model: inside its thinking
    (True), outside (False: nothing to bound), or None: whether the output opens with the start
    marker will say."""

    def __init__(self, budget: int, start: bytes, end: bytes, end_ids: list[int], vocab: int,
                 token_bytes: Callable[[int], bytes], thinking: bool | None) -> None:
        self.budget = budget
        self.start, self.end, self.end_ids = start, end, end_ids
        self.vocab = vocab
        self.token_bytes = token_bytes
        self.state = {True: "thinking", False: "done", None: "start"}[thinking]
        self.spent = 0
        self.tail = b""
        self.forcing: list[int] = []
        self._check_spent()

    def allowed(self) -> bytes | None:
        return pack([self.forcing[0]], self.vocab).tobytes() if self.forcing else None

    def accept(self, token: int) -> None:
        if self.state == "done":
            return
        if self.forcing:
            self.forcing.pop(0)
            if not self.forcing:
                self.state = "done"
            return
        # llguidance spells a special token as 0xFF + its text; 0xFF is never in UTF-8 text.
        self.tail = (self.tail + self.token_bytes(token).replace(b"\xff", b""))[-(len(self.end) + 64):]
        if self.state == "start":
            opened = self.tail.lstrip()
            if opened.startswith(self.start):
                self.state, self.tail = "thinking", opened[len(self.start):]
            elif not self.start.startswith(opened):
                self.state = "done"
            self._check_spent()
            return
        self.spent += 1
        if self.end in self.tail:
            self.state = "done"
        else:
            self._check_spent()

    def _check_spent(self) -> None:
        if self.state == "thinking" and self.spent >= self.budget:
            self.forcing = list(self.end_ids)


class AllOf:
    """Every constraint at once: a token must be allowed by each."""

    def __init__(self, parts: list[Constraint]) -> None:
        self.parts = parts

    def allowed(self) -> bytes | None:
        masks = [m for m in (p.allowed() for p in self.parts) if m is not None]
        if not masks:
            return None
        if len(masks) == 1:
            return masks[0]
        out = np.frombuffer(masks[0], dtype="<u4").copy()
        for m in masks[1:]:
            out &= np.frombuffer(m, dtype="<u4")
        return out.tobytes()

    def accept(self, token: int) -> None:
        for p in self.parts:
            p.accept(token)

    @property
    def closed_early(self) -> bool:
        return any(getattr(p, "closed_early", False) for p in self.parts)
