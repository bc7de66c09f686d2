"""Anthropic's Messages API against real servers with the official ``anthropic`` SDK: answers
whole and streamed (the SDK's own event accumulator), stop sequences, max_tokens, thinking with a
budget on a model whose template opens it, structured output that validates, a tool round trip
(tools -> tool_use -> tool_result -> answer) with tool_choice any and a named tool, count_tokens
equal to what the request then reports, Anthropic's error envelope and codes, an error mid-stream
as an ``error`` event, and a request shaped as Claude Code sends them, twice, the second reading
the first one's prefix from the cache."""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import jsonschema
import pytest

from conftest import DEFAULT_MODEL, OPS_API_KEY, TINY, start_server
from test_tool_calls import TIME, WEATHER

THINKER = "tiny-thinker"
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "Time in a zone", "input_schema": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinker(server_tmp):
    """A random-weight qwen3 checkpoint whose template opens the thinking unless switched off
    and renders tools, with a context long enough for an agent's request; faults can be armed."""
    from chat_templates import THINKING_TOOLS, use_template
    from devtools.checkpoints import make_checkpoint

    model_dir = make_checkpoint("qwen3", server_tmp / "tiny-thinker", seed=6, max_position_embeddings=8192)
    use_template(model_dir, THINKING_TOOLS)
    server = start_server(server_tmp, config=f'[[models]]\nmodel = "{model_dir}"\nid = "{THINKER}"\n'
                                             'max_model_len = 8192\nmax_slots = 4\n[debug]\nfault_injection = true\n')
    yield server
    server.stop()


def client(server, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kw.pop("api_key", "unused"), max_retries=0,
                               timeout=300, **kw)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def kinds(stream) -> list[str]:
    return [e.type for e in stream]


# ----------------------------------------------------------------------------- text


def test_an_answer_whole_and_streamed_is_the_same_message(tp1):
    c = client(tp1)
    body = dict(model=DEFAULT_MODEL, max_tokens=16, extra_body={"temperature": 0}, messages=ASK,
                system=[{"type": "text", "text": "Answer in one short sentence.", "cache_control": {"type": "ephemeral"}}])
    whole = c.messages.create(**body)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == DEFAULT_MODEL
    assert whole.id.startswith("msg_") and [b.type for b in whole.content] == ["text"]
    assert "Paris" in text_of(whole) and whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 10 and 0 < whole.usage.output_tokens <= 16
    with c.messages.stream(**body) as stream:
        events = kinds(stream)
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)
    assert text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_sequence_ends_the_answer_and_is_named(tp1, stream):
    c = client(tp1)
    body = dict(model=DEFAULT_MODEL, max_tokens=32, extra_body={"temperature": 0}, messages=ASK, stop_sequences=["Paris", "zebra"])
    if stream:
        with c.messages.stream(**body) as s:
            out = s.get_final_message()
    else:
        out = c.messages.create(**body)
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "Paris"
    assert "Paris" not in text_of(out)


def test_max_tokens_ends_the_message_with_its_reason(tp1):
    out = client(tp1).messages.create(model=DEFAULT_MODEL, max_tokens=5, extra_body={"temperature": 0},
                                      messages=[{"role": "user", "content": "Write a long story about the sea."}])
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 5 and out.stop_sequence is None


def test_count_tokens_is_the_prompt_the_request_then_reports(tp1):
    c = client(tp1)
    body = dict(model=DEFAULT_MODEL, system="You are a counting assistant.",
                messages=[{"role": "user", "content": "Count the sheep in the meadow, slowly, one by one."}])
    counted = c.messages.count_tokens(**body).input_tokens
    for _ in range(2):  # the second request finds its prefix in the cache: the parts still add up
        u = c.messages.create(max_tokens=2, **body).usage
        assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted
    assert u.cache_read_input_tokens > 0


def test_a_final_assistant_message_is_continued(tp1):
    out = client(tp1).messages.create(model=DEFAULT_MODEL, max_tokens=4, extra_body={"temperature": 0}, messages=[
        *ASK, {"role": "assistant", "content": "The capital of France is"}])
    assert text_of(out).startswith(" Paris")


# ----------------------------------------------------------------------------- thinking


def test_thinking_stops_at_its_budget_and_the_answer_follows(thinker):
    c = client(thinker)

    def thought(budget: int, stream: bool = False):
        body = dict(model=THINKER, max_tokens=30, extra_body={"temperature": 0}, messages=ASK,
                    thinking={"type": "enabled", "budget_tokens": budget})
        if not stream:
            return c.messages.create(**body)
        with c.messages.stream(**body) as s:
            return list(s), s.get_final_message()

    short, long = thought(8), thought(16)
    for out in (short, long):
        assert [b.type for b in out.content] == ["thinking", "text"] and out.content[0].signature
        assert "</think>" not in out.content[0].thinking and text_of(out)
    # Greedy: the longer budget thinks on from where the shorter one was cut off.
    assert long.content[0].thinking.startswith(short.content[0].thinking)
    assert len(long.content[0].thinking) > len(short.content[0].thinking)
    assert [b.type for b in thought(0).content] == ["text"]
    events, final = thought(8, stream=True)
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and "signature_delta" in deltas and deltas[-1] == "text_delta"
    assert [b.model_dump() for b in final.content[1:]] == [b.model_dump() for b in short.content[1:]]
    assert final.content[0].thinking == short.content[0].thinking


def test_the_chat_routes_thinking_token_budget_is_the_same_budget(thinker):
    body = {"model": THINKER, "max_tokens": 30, "temperature": 0, "messages": ASK}
    chat = httpx.post(f"{thinker.url}/v1/chat/completions", json={**body, "thinking_token_budget": 8}, timeout=120)
    message = client(thinker).messages.create(model=THINKER, max_tokens=30, extra_body={"temperature": 0},
                                              messages=ASK, thinking={"type": "enabled", "budget_tokens": 8})
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]["message"]
    assert choice["reasoning_content"] == message.content[0].thinking and choice["content"] == text_of(message)


def test_thinking_disabled_and_omitted(thinker):
    c = client(thinker)
    off = c.messages.create(model=THINKER, max_tokens=8, messages=ASK, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    hidden = c.messages.create(model=THINKER, max_tokens=20, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 4, "display": "omitted"})
    assert hidden.content[0].type == "thinking" and hidden.content[0].thinking == "" and hidden.content[0].signature
    adaptive = c.messages.create(model=THINKER, max_tokens=6, messages=ASK, thinking={"type": "adaptive"})
    assert [b.type for b in adaptive.content] == ["thinking"] and adaptive.stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_output_format_json_schema_validates_after_thinking(thinker, stream):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 16}, "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    body = dict(model=THINKER, max_tokens=120, messages=ASK, thinking={"type": "enabled", "budget_tokens": 6},
                output_config={"format": {"type": "json_schema", "schema": schema}})
    c = client(thinker)
    if stream:
        with c.messages.stream(**body) as s:
            out = s.get_final_message()
    else:
        out = c.messages.create(**body)
    assert out.content[0].type == "thinking"
    jsonschema.validate(json.loads(text_of(out)), schema)


# ----------------------------------------------------------------------------- tools


def tool_uses(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}], ids=["any", "named"])
def test_a_tool_round_trip(tiny, choice, stream):
    c = client(tiny)

    def ask(**kw):
        if not stream:
            return c.messages.create(**kw)
        with c.messages.stream(**kw) as s:
            return s.get_final_message()

    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = ask(model=TINY, max_tokens=200, messages=question, tools=TOOLS, tool_choice=choice)
    calls = tool_uses(first)
    assert calls and first.stop_reason == "tool_use"
    for call in calls:
        assert call.id.startswith("toolu_")
        jsonschema.validate(call.input, SCHEMAS[call.name])
    if choice["type"] == "tool":
        assert [call.name for call in calls] == ["get_time"]
    results = [{"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny, 21 C"}]}
               for call in calls]
    history = [*question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": results}]
    # Greedy: sampled at Anthropic's default temperature of 1, the random model sometimes drew its
    # end token first and answered no text.
    answer = ask(model=TINY, max_tokens=6, messages=history, tools=TOOLS, tool_choice={"type": "none"},
                 extra_body={"temperature": 0})
    assert not tool_uses(answer) and answer.stop_reason in ("max_tokens", "end_turn") and text_of(answer)
    # The tool's result reached the prompt: the same conversation without it is shorter.
    assert answer.usage.input_tokens > ask(model=TINY, max_tokens=1, messages=question).usage.input_tokens + 20


def test_disable_parallel_tool_use_makes_one_call(tiny):
    out = client(tiny).messages.create(model=TINY, max_tokens=300, tools=TOOLS, messages=ASK,
                                       tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert len(tool_uses(out)) == 1


def test_tool_input_streams_as_json_deltas(tiny):
    with client(tiny).messages.stream(model=TINY, max_tokens=200, tools=TOOLS, messages=ASK,
                                      tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert len(starts) == 1 and starts[0].content_block.name == "get_weather" and len(pieces) > 1
    assert json.loads("".join(pieces)) == tool_uses(final)[0].input


# ----------------------------------------------------------------------------- errors


def test_errors_come_in_anthropics_envelope_with_its_codes(tp1, ops):
    c = client(tp1)
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model=DEFAULT_MODEL, max_tokens=4, messages=ASK, extra_body={"frobnicate": 1})
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "frobnicate" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        client(ops, api_key="wrong").messages.create(model=DEFAULT_MODEL, max_tokens=4, messages=ASK)
    ok = client(ops, api_key=OPS_API_KEY).messages.create(model=DEFAULT_MODEL, max_tokens=2, messages=ASK)
    assert ok.usage.output_tokens == 2  # x-api-key, as the SDK sends it
    r = httpx.post(f"{ops.url}/v1/messages?beta=true", json={"model": DEFAULT_MODEL, "max_tokens": 2, "messages": ASK},
                   headers={"Authorization": f"Bearer {OPS_API_KEY}", "anthropic-version": "2023-06-01",
                            "anthropic-beta": "interleaved-thinking-2025-05-14"}, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_overloaded_is_529_and_a_failure_mid_stream_is_an_error_event(thinker):
    from neuron.errors import ApiError
    from neuron.server.messages.errors import error_response

    shed = error_response(ApiError(503, "model_unavailable", "loading", retry_after=5))
    assert shed.status_code == 529 and json.loads(shed.body)["error"]["type"] == "overloaded_error"
    lines: list[str] = []
    started = threading.Event()

    def read():
        body = {"model": THINKER, "max_tokens": 2000, "messages": ASK, "stream": True, "thinking": {"type": "adaptive"}}
        with httpx.stream("POST", f"{thinker.url}/v1/messages", json=body, timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)
                if "thinking_delta" in line:
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    assert httpx.post(f"{thinker.url}/debug/fault", json={"model": THINKER, "rank": 0, "kind": "oom"}).status_code == 200
    reader.join(60)
    events = [line[7:] for line in lines if line.startswith("event: ")]
    assert events[-1] == "error" and "message_stop" not in events
    error = json.loads(lines[lines.index("event: error") + 1][6:])
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"


# ----------------------------------------------------------------------------- an agent's request

AGENT_TOOLS = ["Task", "Bash", "Glob", "Grep", "LS", "Read", "Edit", "MultiEdit", "Write", "NotebookEdit", "WebFetch",
               "TodoWrite"]


def agent_tools() -> list[dict]:
    """A dozen tools of the shape Claude Code sends (names, long descriptions, object schemas)."""
    return [{"name": name, "description": f"{name}: " + "Use this tool when the task needs it. " * 2,
             "input_schema": {"type": "object", "$schema": "http://json-schema.org/draft-07/schema#",
                              "additionalProperties": False, "required": ["target"],
                              "properties": {"target": {"type": "string", "description": "what to act on"},
                                             "limit": {"type": "number", "description": "at most this many"}}}}
            for name in AGENT_TOOLS]


def agent_request(session_hash: str, turns: list[dict]) -> dict:
    system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; "
                                       f"cch={session_hash};"},
              {"type": "text", "text": "You are Claude Code, a command line coding agent.",
               "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Follow the repository's conventions. " * 12, "cache_control": {"type": "ephemeral"}}]
    history = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>The date is today.</system-reminder>"},
                                     {"type": "text", "text": "Find why the tests fail."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should read the test file first.", "signature": "sig-1"},
            {"type": "text", "text": "Let me read the tests."},
            {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"target": "tests/test_a.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                      "content": [{"type": "text", "text": "def test_a():\n    assert f() == 2\n" * 8}]}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_02", "name": "Bash", "input": {"target": "pytest -q"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_02", "is_error": True,
                                      "content": "FAILED tests/test_a.py::test_a - assert 1 == 2\n" * 4}]},
        *turns,
    ]
    history[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return dict(model=THINKER, max_tokens=48, system=system, tools=agent_tools(), messages=history,
                thinking={"type": "enabled", "budget_tokens": 12}, metadata={"user_id": "user_7f_account__session_3a"},
                betas=["claude-code-20250219", "interleaved-thinking-2025-05-14",
                       "fine-grained-tool-streaming-2025-05-14"])


def test_a_claude_code_shaped_request_streams_and_its_next_turn_reads_the_cache(thinker):
    c = client(thinker)
    ask = [{"role": "user", "content": [{"type": "text", "text": "What does the failure say?"}]}]
    with c.beta.messages.stream(**agent_request("81f3a", ask)) as stream:  # POST /v1/messages?beta=true
        events = [e.type for e in stream]
        first = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [b.type for b in first.content][:1] == ["thinking"]
    assert first.usage.input_tokens > 1500 and first.usage.cache_read_input_tokens == 0
    reply = [b.model_dump(exclude_none=True) for b in first.content]
    more = ask + [{"role": "assistant", "content": reply},
                  {"role": "user", "content": [{"type": "text", "text": "Fix it."}]}]
    with c.beta.messages.stream(**agent_request("c09e2", more)) as stream:  # a new billing hash, as each request has
        second = stream.get_final_message()
    # The whole first prompt is the second's prefix, whatever the billing block said.
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens - 64
