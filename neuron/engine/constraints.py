"""Token constraints besides grammars: a fixed set of allowed tokens (``allowed_token_ids``),
banned words (``bad_words``), a constraint that starts after a marker (structured output after a
reasoning model's thinking), and several at once. Each is a ``TokenConstraint``: the engine asks
``allowed`` before a sampling step and reports the drawn token with ``accept``."""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from .grammar_budget import pack


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
