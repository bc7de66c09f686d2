"""Structured output against a real server: a random-weight model (it wants nothing of the
grammar) gives output that parses and validates on every try, streaming and not, 8 at once;
the default model answers in the requested shape too."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from conftest import DEFAULT_MODEL, TINY

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=300)


def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=300)


async def one(server, stream: bool, response_format: dict, max_tokens: int, seed: int) -> tuple[str, str]:
    kw = dict(model=TINY, messages=MESSAGES, response_format=response_format, max_tokens=max_tokens,
              temperature=1.0, seed=seed)
    async with aclient(server) as c:
        if not stream:
            out = await c.chat.completions.create(**kw)
            return out.choices[0].message.content, out.choices[0].finish_reason
        text, finish = "", None
        async for chunk in await c.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish


async def eight(server, response_format: dict, max_tokens: int) -> list[tuple[str, str]]:
    return await asyncio.gather(*(one(server, i % 2 == 0, response_format, max_tokens, seed=100 + i)
                                  for i in range(8)))


def test_a_nested_schema_validates_on_every_try_with_random_weights_streaming_or_not(tiny):
    for text, finish in asyncio.run(eight(tiny, SCHEMA_FORMAT, 150)):
        jsonschema.validate(json.loads(text), PERSON)
        assert finish in ("stop", "length")


def test_json_object_parses_on_every_try_with_random_weights_streaming_or_not(tiny):
    for text, finish in asyncio.run(eight(tiny, {"type": "json_object"}, 60)):
        assert isinstance(json.loads(text), dict)


def test_a_tight_budget_still_closes_the_json_and_says_length(tiny):
    out = client(tiny).chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=12, temperature=1.0,
                                               seed=3, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    assert out.usage.completion_tokens <= 12


def test_n_choices_each_follow_the_schema(tiny):
    out = client(tiny).chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=150, n=3, seed=9,
                                               response_format=SCHEMA_FORMAT)
    assert [c.index for c in out.choices] == [0, 1, 2]
    values = [json.loads(c.message.content) for c in out.choices]
    for v in values:
        jsonschema.validate(v, PERSON)
    assert len({json.dumps(v) for v in values}) == 3


@pytest.mark.parametrize("extra,check", [
    ({"guided_regex": r"[0-9]{3}-[a-z]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{4}", t)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
     lambda t: isinstance(json.loads(t), list) and all(isinstance(x, int) for x in json.loads(t))),
    ({"guided_grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'}, lambda t: re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", t)),
    ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,6}"}}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,6}", t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                      "additionalProperties": False}, "disable_any_whitespace": True}},
     lambda t: t in ('{"ok":true}', '{"ok":false}')),
    ({"structured_outputs": {"grammar": 'start: "x" /[ab]{2}/ "y"'}}, lambda t: re.fullmatch("x[ab]{2}y", t)),
])
def test_vllm_guided_and_structured_outputs_hold_on_chat_and_completions(tiny, extra, check):
    for route, body in (("chat/completions", {"messages": MESSAGES}), ("completions", {"prompt": "Answer:"})):
        r = httpx.post(f"{tiny.base}/{route}", json={"model": TINY, "max_tokens": 60, "seed": 4, **body, **extra},
                       timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if route == "chat/completions" else choice["text"]
        assert check(text), (route, text)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": []}}, "response_format"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
])
def test_a_grammar_that_cannot_work_is_a_400_naming_its_field(tiny, body, param):
    r = httpx.post(f"{tiny.base}/chat/completions", json={"model": TINY, "messages": MESSAGES, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_default_model_answers_in_the_schema(tp1):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    out = client(tp1).chat.completions.create(
        model=DEFAULT_MODEL, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    value = json.loads(out.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert "Paris" in value["city"]
