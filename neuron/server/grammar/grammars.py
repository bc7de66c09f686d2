"""Structured output on the leader: grammars (JSON schema, any JSON object, regex, choice, Lark or
GBNF) compiled with llguidance into per-sequence ``TokenConstraint``s whose token masks the rank
applies while sampling. llguidance is Rust behind a torch-free binding and computes each mask
lazily (no automaton over the whole vocabulary up front): any schema compiles in about a
millisecond and a mask over 49k tokens takes ~0.1 ms. Each constraint also keeps its output within
the token budget (``grammar_budget``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import llguidance as llg
from tokenizers import Tokenizer

from .budget import Budget, VocabTables, build_tables

log = logging.getLogger("neuron.grammar")

# Whitespace allowed between JSON tokens unless the request says otherwise: one space (as
# json.dumps writes) or a line break and its indentation (pretty-printed). Bounded: small models
# fall into endless whitespace when any amount is allowed.
JSON_WHITESPACE = r"(?:[\x20\x09]?|\x0D?\x0A[\x20\x09]{0,32})"


class GrammarError(ValueError):
    """The grammar or schema does not compile; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. ``kind``: json_schema | json_object | regex | choice | grammar
    (Lark or GBNF) | lark (internal: already Lark, e.g. a tool-call syntax)."""

    kind: str
    source: Any
    whitespace: str | None = JSON_WHITESPACE  # None: no whitespace between JSON tokens
    no_additional_properties: bool = False


def json_options(whitespace: str | None) -> dict[str, Any]:
    if whitespace is None:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": False, "whitespace_pattern": whitespace}


_LITERAL_KEYS = ("enum", "const", "default", "examples")


def close_objects(schema: Any) -> Any:
    """``additionalProperties: false`` wherever an object schema leaves it open (vLLM's
    ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _LITERAL_KEYS else close_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def to_lark_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar text for ``spec`` (not yet checked against a tokenizer)."""
    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.source if spec.kind == "json_schema" else {"type": "object"}
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be an object")
            if spec.no_additional_properties:
                schema = close_objects(schema)
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=json_options(spec.whitespace))
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(str(spec.source))
        if spec.kind == "choice":
            choices = list(spec.source)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice must be a non-empty list of strings")
            return llg.grammar_from("choice", choices)  # type: ignore[arg-type]
        if spec.kind == "grammar":
            return llg.grammar_from("grammar", str(spec.source))
        if spec.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(str(spec.source))
    except GrammarError:
        raise
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


class Compiler(Protocol):
    """Compiles a client's grammar where llguidance cannot take the caller down with it."""

    def compile(self, grammars: Grammars, spec: GrammarSpec) -> str: ...

    def admit(self, spec: GrammarSpec) -> None:
        """Raise GrammarError if ``spec`` goes past the configured size and depth limits."""


class Grammars:
    """llguidance's view of one model's tokenizer (built once, ~0.2 s for 49k tokens), the
    budget tables, and the constraints made from it."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos: list[int]) -> None:
        self.vocab = vocab
        self.eos = list(eos)
        self.source = tokenizer.to_str()  # what a compiling worker builds its own view from
        self.key = hashlib.sha256(self.source.encode()).hexdigest()[:32]
        self.tokenizer = llg.LLTokenizer(self.source, n_vocab=vocab, eos_token=self.eos or None)
        self.tables = build_tables(self.tokenizer, vocab, self.eos)

    def check(self, spec: GrammarSpec, compiler: Compiler) -> str:
        """Compile ``spec`` for this tokenizer (in the compiler's worker process); a GrammarError
        says what is wrong with it."""
        return compiler.compile(self, spec)

    def constraint(self, grammar: str, max_tokens: int, phase: int = 0) -> GrammarConstraint:
        return GrammarConstraint(llg.LLMatcher(self.tokenizer, grammar), self.tables, max_tokens, phase)


class GrammarConstraint:
    """One sequence's grammar state: the engine asks ``allowed`` before each sampling step and
    reports every drawn token with ``accept``."""

    def __init__(self, matcher: llg.LLMatcher, tables: VocabTables, max_tokens: int, phase: int = 0) -> None:
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self.matcher = matcher
        self.tables = tables
        self.budget = Budget(tables, max_tokens, phase)

    def allowed(self) -> bytes:
        # This runs in the engine's step loop: a failure here must end this output, not the step.
        try:
            if not self.matcher.is_error():  # an error cannot happen while the rank honours the masks
                return self.budget.mask(self.matcher).tobytes()
        except Exception:
            log.exception("grammar mask failed; ending the output")
        return self.tables.eos_mask.tobytes()

    def accept(self, token: int) -> None:
        self.budget.remaining -= 1
        self.budget.took(token)
        if token in self.tables.eos:
            return
        if not self.matcher.consume_token(token):
            log.warning("grammar refused token %d: %s", token, self.matcher.get_error())

    def spend(self) -> None:
        """A token was drawn before this constraint applied (it starts after the reasoning)."""
        self.budget.remaining -= 1

    @property
    def closed_early(self) -> bool:
        """The budget set the output on its shortest way to the end: report ``length``."""
        return self.budget.closing

    @property
    def complete(self) -> bool:
        return self.matcher.is_accepting()


_cache: dict[int, Grammars] = {}
_lock = threading.Lock()


def grammars_for(tokenizer: Tokenizer, vocab: int, eos: list[int]) -> Grammars:
    """The shared Grammars of a tokenizer object (built on first use, dropped with it)."""
    key = id(tokenizer)
    with _lock:
        found = _cache.get(key)
        if found is not None:
            return found
    built = Grammars(tokenizer, vocab, eos)
    with _lock:
        if key not in _cache:
            _cache[key] = built
            weakref.finalize(tokenizer, _cache.pop, key, None)
        return _cache[key]
