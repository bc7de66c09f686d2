"""What a request asks its output to match: ``response_format`` (OpenAI), ``guided_*`` and
``structured_outputs`` (vLLM), read into one GrammarSpec, or None. At most one may be given; a
malformed one is a 400 naming the field."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from neuron.server.grammar.grammars import JSON_WHITESPACE, GrammarSpec
from neuron.errors import ApiError

from neuron.server.schemas import SamplingFields


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


def _schema(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise _bad("the JSON schema is not valid JSON", param) from None
    if not isinstance(value, dict):
        raise _bad("a JSON schema must be an object", param)
    return value


def from_response_format(rf: dict[str, Any], param: str = "response_format") -> GrammarSpec | None:
    """OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
    "schema", "strict"}}`` (and the Responses API's flat ``text.format``: name/schema beside type)."""
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", None)
    if kind == "json_schema":
        inner = rf.get("json_schema", rf)
        if not isinstance(inner, dict):
            raise _bad("json_schema must be an object with a schema", f"{param}.json_schema")
        schema = inner.get("schema", inner.get("json_schema"))
        if schema is None:
            raise _bad("json_schema needs a schema", f"{param}.json_schema")
        # strict or not, the output follows the schema: sampling enforces it either way.
        return GrammarSpec("json_schema", _schema(schema, f"{param}.json_schema.schema"))
    if kind == "structural_tag":
        raise _bad("structural tags are not supported", param)
    raise _bad('response_format type must be "text", "json_object" or "json_schema"', f"{param}.type")


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "whitespace_pattern",
                    "disable_any_whitespace", "disable_additional_properties", "disable_fallback")


def _from_structured_outputs(so: dict[str, Any]) -> GrammarSpec | None:
    unknown = set(so) - set(_STRUCTURED_KEYS)
    if unknown:
        raise _bad(f"unknown structured_outputs keys: {', '.join(sorted(unknown))}", "structured_outputs")
    if so.get("structural_tag") is not None:
        raise _bad("structural tags are not supported", "structured_outputs.structural_tag")
    kinds = [k for k in ("json", "regex", "choice", "grammar") if so.get(k) is not None]
    if so.get("json_object"):
        kinds.append("json_object")
    if len(kinds) > 1:
        raise _bad("structured_outputs takes one of json, regex, choice, grammar, json_object", "structured_outputs")
    if not kinds:
        return None
    kind = kinds[0]
    if kind == "json":
        return GrammarSpec("json_schema", _schema(so["json"], "structured_outputs.json"))
    if kind == "json_object":
        return GrammarSpec("json_object", None)
    if kind == "choice":
        return GrammarSpec("choice", _choices(so["choice"], "structured_outputs.choice"))
    if not isinstance(so[kind], str):
        raise _bad(f"{kind} must be a string", f"structured_outputs.{kind}")
    return GrammarSpec(kind, so[kind])


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise _bad("choice must be a non-empty list of strings", param)
    return value


def output_grammar(body: SamplingFields) -> tuple[GrammarSpec, str] | None:
    """(the grammar, the field it came from), or None for free text."""
    found: list[tuple[GrammarSpec, str]] = []
    if body.response_format is not None:
        spec = from_response_format(body.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if body.guided_json is not None:
        found.append((GrammarSpec("json_schema", _schema(body.guided_json, "guided_json")), "guided_json"))
    if body.guided_regex is not None:
        found.append((GrammarSpec("regex", body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        found.append((GrammarSpec("choice", _choices(body.guided_choice, "guided_choice")), "guided_choice"))
    if body.guided_grammar is not None:
        found.append((GrammarSpec("grammar", body.guided_grammar), "guided_grammar"))
    so = body.structured_outputs or {}
    spec = _from_structured_outputs(so)
    if spec is not None:
        found.append((spec, "structured_outputs"))
    if len(found) > 1:
        raise _bad("give one of response_format, guided_json, guided_regex, guided_choice, guided_grammar and "
                   "structured_outputs", found[1][1])
    if not found:
        return None
    return replace(found[0][0], whitespace=whitespace_of(body),
                   no_additional_properties=bool(so.get("disable_additional_properties"))), found[0][1]


def whitespace_of(body: SamplingFields) -> str | None:
    """The whitespace allowed between JSON tokens: none (``disable_any_whitespace``), the
    request's pattern, or our bounded default."""
    so = body.structured_outputs or {}
    if so.get("disable_any_whitespace"):
        return None
    pattern = so.get("whitespace_pattern") or body.guided_whitespace_pattern
    if pattern is not None and not isinstance(pattern, str):
        raise _bad("whitespace_pattern must be a string", "structured_outputs.whitespace_pattern")
    return pattern or JSON_WHITESPACE
