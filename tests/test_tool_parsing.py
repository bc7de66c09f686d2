"""Tool-call syntaxes and reasoning markers read out of recorded model outputs, fed whole, split at
every character boundary, and one character at a time: the result never depends on how the text
was cut."""

from __future__ import annotations

import json

import pytest

from neuron.parsing.reasoning import KNOWN_MARKERS, ReasoningSplitter, reasoning_markers, starts_thinking
from neuron.parsing.tool_calls import PARSERS, CallArgs, CallStart

TOOLS = {"get_weather", "get_time", "search"}


def fold(events) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, [(name, arguments)], ids) from a parser's events."""
    content, calls, ids = "", [], []
    for ev in events:
        if isinstance(ev, str):
            content += ev
        elif isinstance(ev, CallStart):
            assert ev.index == len(calls)
            calls.append([ev.name, ""])
            ids.append(ev.id)
        else:
            assert isinstance(ev, CallArgs) and ev.index == len(calls) - 1
            calls[-1][1] += ev.text
    return content, [tuple(c) for c in calls], ids


def parse(syntax: str, pieces: list[str]):
    parser = PARSERS[syntax](TOOLS)
    events = [ev for piece in pieces for ev in parser.push(piece)] + parser.flush()
    return fold(events)


def cuts(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


RECORDED = [
    # Qwen2.5 / Hermes 2 Pro
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me check both.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"q": "a \\"}\\" b </tool_call>", "n": [1, {"x": 2}]}}\n</tool_call>',
     "", [("search", {"q": 'a "}" b </tool_call>', "n": [1, {"x": 2}]})]),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
     "", [("get_weather", {"city": "Oslo"})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>',
     "", [("get_time", {"tz": "UTC"})]),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [("get_time", {})]),
    ("hermes", "The weather in Paris is sunny, 21 degrees.", "The weather in Paris is sunny, 21 degrees.", []),
    ("hermes", "Wrap calls in <tool_call> tags <tool_call>not json", "Wrap calls in <tool_call> tags <tool_call>not json", []),
    # Llama 3.1 / 3.2
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "search", "parameters": {"q": "llamas", "k": 3}}',
     "", [("search", {"q": "llamas", "k": 3})]),
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
     "", [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    ("llama3_json", '{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', []),
    ("llama3_json", '{"name": "Bob", "parameters": {"age": 3}}', '{"name": "Bob", "parameters": {"age": 3}}', []),
    ("llama3_json", "Paris is the capital of France.", "Paris is the capital of France.", []),
    # Mistral
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}',
     "", [("get_weather", {"city": "Paris", "days": [1, 2]})]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", "No tools needed: it is [TOOL] time.", "No tools needed: it is [TOOL] time.", []),
]


@pytest.mark.parametrize("syntax,output,content,calls", RECORDED,
                         ids=[f"{s}-{i}" for i, (s, *_) in enumerate(RECORDED)])
def test_a_recorded_output_parses_the_same_however_it_is_split(syntax, output, content, calls):
    for pieces in cuts(output):
        got_content, got_calls, ids = parse(syntax, pieces)
        assert got_content == content, pieces
        assert [(name, json.loads(args)) for name, args in got_calls] == calls, pieces
        assert len(set(ids)) == len(ids)


def test_arguments_stream_out_before_the_call_is_closed():
    parser = PARSERS["hermes"](TOOLS)
    events = parser.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert isinstance(events[0], CallStart) and events[0].name == "get_weather"
    assert "".join(e.text for e in events if isinstance(e, CallArgs)) == '{"city": "Par'


def test_mistral_call_ids_are_nine_letters_and_digits():
    _, _, ids = parse("mistral", ['[TOOL_CALLS]get_time[ARGS]{}'])
    assert len(ids[0]) == 9 and ids[0].isalnum()


def test_a_call_cut_off_by_the_token_limit_keeps_what_was_written():
    content, calls, _ = parse("hermes", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'])
    assert content == "" and calls == [("get_weather", '{"city": "Pa')]


THINKING = [
    ("<think>\nThe user wants a greeting.\n</think>\n\nHello!", None, "\nThe user wants a greeting.\n", "Hello!"),
    ("The user wants a greeting.\n</think>\n\nHello!", True, "The user wants a greeting.\n", "Hello!"),
    ("Hello!", False, "", "Hello!"),
    ("Hello <think> is a tag.", None, "", "Hello <think> is a tag."),
    ("<think>unfinished thought", None, "unfinished thought", ""),
]


@pytest.mark.parametrize("output,thinking,reasoning,content", THINKING)
def test_thinking_is_split_from_the_answer_however_it_is_cut(output, thinking, reasoning, content):
    for pieces in cuts(output):
        splitter = ReasoningSplitter(KNOWN_MARKERS["think"], thinking)
        parts = [splitter.push(p) for p in pieces] + [splitter.flush()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content), pieces


def test_markers_come_from_the_template_or_the_configuration():
    qwen3 = "{%- if enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    assert reasoning_markers("auto", qwen3) == KNOWN_MARKERS["think"]
    assert reasoning_markers("auto", "{{ '<seed:think>' }}") == KNOWN_MARKERS["seed"]
    assert reasoning_markers("auto", "{{ messages }}") is None
    assert reasoning_markers("none", qwen3) is None
    assert reasoning_markers("mistral", None) == KNOWN_MARKERS["mistral"]
    think = KNOWN_MARKERS["think"]
    assert starts_thinking("<|im_start|>assistant\n<think>\n", think) is True
    assert starts_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", think) is False
    assert starts_thinking("<|im_start|>assistant\n", think) is None
