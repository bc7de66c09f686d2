"""/v1/responses with the official client's ``responses.create``, streaming and not: text and
message input, instructions, max_output_tokens, structured output through ``text.format``,
function calls as output items and their results in the next turn via previous_response_id."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from conftest import DEFAULT_MODEL, TINY
from neuron.response_store import ResponseStore
from test_tool_calls import TIME, TOOLS

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=300)


def test_a_text_input_gets_an_answer_without_streaming(tp1):
    out = client(tp1).responses.create(model=DEFAULT_MODEL, input="What is the capital of France?",
                                       instructions="Answer in one short sentence.", temperature=0,
                                       max_output_tokens=16)
    assert out.object == "response" and out.status in ("completed", "incomplete")
    assert "Paris" in out.output_text
    assert out.output[0].type == "message" and out.output[0].content[0].type == "output_text"
    assert 0 < out.usage.output_tokens <= 16 and out.usage.input_tokens > 10


def test_streamed_events_add_up_to_the_completed_response(tp1):
    stream = client(tp1).responses.create(
        model=DEFAULT_MODEL, temperature=0, max_output_tokens=12, stream=True,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}])
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.done",
            "response.output_item.done"} <= set(kinds)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and "Paris" in deltas
    assert events[-1].response.output_text == deltas
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))


def test_max_output_tokens_ends_the_response_as_incomplete(tp1):
    out = client(tp1).responses.create(model=DEFAULT_MODEL, input="Write a long story about the sea.",
                                       max_output_tokens=5, temperature=0)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema_holds_with_random_weights(tiny, stream):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 16}, "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    kw = dict(model=TINY, input="Answer as JSON.", max_output_tokens=100,
              text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    if stream:
        events = list(client(tiny).responses.create(stream=True, **kw))
        text = events[-1].response.output_text
    else:
        text = client(tiny).responses.create(**kw).output_text
    jsonschema.validate(json.loads(text), schema)


def test_function_calls_are_output_items_and_their_results_continue_the_conversation(tiny):
    c = client(tiny)
    first = c.responses.create(model=TINY, input="What time is it in Paris?", tools=FLAT_TOOLS,
                               tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=200)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time"
    jsonschema.validate(json.loads(calls[0].arguments), TIME)
    events = list(c.responses.create(
        model=TINY, previous_response_id=first.id, tools=FLAT_TOOLS, max_output_tokens=6, stream=True,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "09:30"}]))
    final = events[-1].response
    assert final.output_text and final.previous_response_id == first.id
    # The earlier turn (question, call, result) is in this prompt.
    assert final.usage.input_tokens > first.usage.input_tokens + 20


def test_required_tool_calls_stream_as_function_call_events(tiny):
    events = list(client(tiny).responses.create(model=TINY, input="Weather and time in Oslo?", tools=FLAT_TOOLS,
                                                tool_choice="required", max_output_tokens=250, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    for e in done:
        deltas = "".join(d.delta for d in events if d.type == "response.function_call_arguments.delta"
                         and d.item_id == e.item_id)
        assert deltas == e.arguments
        json.loads(e.arguments)


def test_an_unknown_previous_response_is_a_404_and_bad_fields_are_400s(tiny):
    r = httpx.post(f"{tiny.base}/responses", json={"model": TINY, "input": "hi", "previous_response_id": "resp_x"},
                   timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    for body, param in (({"background": True}, "background"), ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
                        ({"input": [{"type": "image", "url": "x"}]}, "input.0.type"),
                        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.json_schema"),
                        ({"reasoning": {"effort": "high"}}, "reasoning"), ({"max_output_tokens": 0}, "max_output_tokens")):
        r = httpx.post(f"{tiny.base}/responses", json={"model": TINY, "input": "hi", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_stored_response_can_be_read_back(tiny):
    out = client(tiny).responses.create(model=TINY, input="hi", max_output_tokens=3)
    again = client(tiny).responses.retrieve(out.id)
    assert again.id == out.id and again.output_text == out.output_text


def test_the_store_forgets_the_least_recently_used_beyond_its_size():
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(name, [{"role": "user", "content": name}], {"id": name})
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", [], {"id": "c"})
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert ResponseStore(0).get("x") is None
