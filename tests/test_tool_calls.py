"""Tool calling against a real server with the official client: a random-weight model with a
Qwen3-style template makes the calls that tool_choice "required" or a named function demands,
in its own <tool_call> syntax, parsed into tool_calls (whole and as streamed deltas); the results
go back in tool messages and the model answers. A template that knows no tools (the default
model's) gets a tool prompt of ours. Thinking is split into reasoning_content."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from conftest import TINY

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=300)


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(stream) -> tuple[str, list[dict], str | None, list]:
    """(content, calls as {id, name, arguments}, finish reason, the tool_calls deltas) of a stream."""
    content, calls, finish, deltas = "", {}, None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            deltas.append(d)
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None and d.type == "function" and d.function.name
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish, deltas


def ask(c: openai.OpenAI, stream: bool, **kw) -> tuple[str, list[dict], str | None]:
    """(content, calls as {id, name, arguments}, finish reason), streamed or not."""
    if not stream:
        out = c.chat.completions.create(**kw)
        message = out.choices[0].message
        assert all(t.type == "function" for t in message.tool_calls or [])
        calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                 for t in message.tool_calls or []]
        return message.content or "", calls, out.choices[0].finish_reason
    content, calls, finish, deltas = streamed(c.chat.completions.create(stream=True, **kw))
    if calls:
        assert len(deltas) > len(calls)  # the name first, then the arguments in pieces
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_a_tool_call_round_trip(tiny, tool_choice, stream):
    c = client(tiny)
    plain = c.chat.completions.create(model=TINY, messages=ASK, tools=TOOLS, max_tokens=1)
    content, calls, finish = ask(c, stream, model=TINY, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                 max_tokens=200, seed=1)
    assert content == "" and finish == "tool_calls" and calls
    if isinstance(tool_choice, dict):
        assert [call["name"] for call in calls] == ["get_time"]
    for call in calls:
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
        for call in calls]}] + [
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"result": "sunny, 09:30"})}
        for call in calls]
    content, more_calls, finish = ask(c, stream, model=TINY, messages=follow, tools=TOOLS, max_tokens=8, seed=1)
    assert content and not more_calls and finish in ("stop", "length")
    # The template rendered the calls and their results into the prompt.
    answer = c.chat.completions.create(model=TINY, messages=follow, tools=TOOLS, max_tokens=1)
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 20 * len(calls)


def test_parallel_tool_calls_false_makes_exactly_one_call(tiny):
    for seed in range(2):
        out = client(tiny).chat.completions.create(model=TINY, messages=ASK, tools=TOOLS, tool_choice="required",
                                                   parallel_tool_calls=False, max_tokens=200, seed=seed)
        assert len(out.choices[0].message.tool_calls) == 1


def test_tool_choice_none_renders_no_tools_and_parses_none(tiny):
    c = client(tiny)
    plain = c.chat.completions.create(model=TINY, messages=ASK, max_tokens=4, seed=1)
    none = c.chat.completions.create(model=TINY, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4, seed=1)
    auto = c.chat.completions.create(model=TINY, messages=ASK, tools=TOOLS, max_tokens=4, seed=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None


def test_auto_parses_the_models_own_tool_call_syntax_streamed(tiny):
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    body = {"model": TINY, "messages": ASK, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 200,
            "guided_regex": forced.replace("{", r"\{").replace("}", r"\}"), "stream": True}
    content, calls, finish = "", {}, None
    with httpx.stream("POST", f"{tiny.base}/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                content += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
                for d in choice["delta"].get("tool_calls") or []:
                    call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                    call["name"] += d.get("function", {}).get("name") or ""
                    call["arguments"] += d.get("function", {}).get("arguments") or ""
    assert content == "" and finish == "tool_calls"
    assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{{ '<|im_start|>assistant\\n' }}")


def test_a_template_without_tools_gets_our_tool_prompt(tiny):
    c = client(tiny)
    kw = dict(model=TINY, messages=ASK, extra_body={"chat_template": CHATML})
    out = c.chat.completions.create(tools=TOOLS, tool_choice="required", max_tokens=200, seed=4, **kw)
    check_calls(out.choices[0].message.tool_calls)
    plain = c.chat.completions.create(max_tokens=1, **kw)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 100


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_a_400_naming_the_field(tiny, body, param):
    r = httpx.post(f"{tiny.base}/chat/completions", json={"model": TINY, "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ----------------------------------------------------------------------------- reasoning

THOUGHT = r"<think>[a-z ]{5,30}</think>\n\nHello"


def test_thinking_goes_to_reasoning_content_whole_and_streamed(tiny):
    c = client(tiny)
    body = dict(model=TINY, messages=ASK, max_tokens=60, seed=3, extra_body={"guided_regex": THOUGHT})
    whole = c.chat.completions.create(**body)
    message = whole.choices[0].message
    assert message.content == "Hello"
    assert 5 <= len(message.reasoning_content) <= 30 and "<think>" not in message.reasoning_content
    reasoning, content = "", ""
    for chunk in c.chat.completions.create(stream=True, **body):
        if chunk.choices:
            delta = chunk.choices[0].delta
            assert not (getattr(delta, "reasoning_content", None) and delta.content)
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, "Hello")


def test_enable_thinking_false_reaches_the_template(tiny):
    out = client(tiny).chat.completions.create(
        model=TINY, messages=ASK, max_tokens=60, seed=3,
        extra_body={"guided_regex": THOUGHT, "chat_template_kwargs": {"enable_thinking": False}})
    message = out.choices[0].message
    # The template closed the thinking in the prompt: all of the answer is content.
    assert message.content.startswith("<think>") and getattr(message, "reasoning_content", None) is None


def test_include_reasoning_false_drops_the_thinking(tiny):
    out = client(tiny).chat.completions.create(model=TINY, messages=ASK, max_tokens=60, seed=3,
                                               extra_body={"guided_regex": THOUGHT, "include_reasoning": False})
    assert out.choices[0].message.content == "Hello"
    assert getattr(out.choices[0].message, "reasoning_content", None) is None
