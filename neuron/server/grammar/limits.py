"""Size and depth limits a client grammar must keep before any grammar engine sees it: cheap
checks in Python that refuse the obviously hostile at once, before the worker process
(``grammar_worker``) that stands between llguidance and the leader."""

from __future__ import annotations

import json
from typing import Any

from neuron.config import GrammarConfig

from .grammars import GrammarError, GrammarSpec


def _depth(value: Any, limit: int) -> int:
    """The nesting depth of a JSON document, counted without recursion (the document may be
    deeper than Python's own stack allows)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return depth
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node)
    return deepest


def _refs(value: Any) -> int:
    count = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            count += "$ref" in node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def check_limits(spec: GrammarSpec, limits: GrammarConfig) -> None:
    """Raise GrammarError naming the limit ``spec`` goes past."""
    source = spec.source
    if spec.kind == "choice":
        choices = list(source or ())
        if len(choices) > limits.max_choices:
            raise GrammarError(f"{len(choices)} choices; at most {limits.max_choices} are allowed")
        size = sum(len(str(c).encode()) for c in choices)
    elif spec.kind in ("json_schema", "json_object"):
        if isinstance(source, str):
            size = len(source.encode())
            if size <= limits.max_bytes:
                try:
                    source = json.loads(source)
                except (ValueError, RecursionError):
                    raise GrammarError("the JSON schema is not valid JSON") from None
            else:
                source = None
        depth = _depth(source, limits.max_depth)
        if depth > limits.max_depth:
            raise GrammarError(f"the JSON schema nests deeper than {limits.max_depth} levels")
        if not isinstance(spec.source, str):
            size = len(json.dumps(source, separators=(",", ":"))) if source is not None else 0
        refs = _refs(source)
        if refs > limits.max_refs:
            raise GrammarError(f"the JSON schema has {refs} $ref; at most {limits.max_refs} are allowed")
    else:
        size = len(str(source).encode())
    if size > limits.max_bytes:
        raise GrammarError(f"it is {size} bytes; at most {limits.max_bytes} are allowed")
