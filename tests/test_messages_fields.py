"""Every request field of Anthropic's Messages API either works or is refused with a 400 whose
message starts with the field's name: the walk sends each with a value that would change the
answer and checks the change (or the refusal). Fields Anthropic's API does not know are refused
too, as Anthropic refuses them."""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import pytest

from conftest import DEFAULT_MODEL, TINY
from neuron.server.messages.request import MessagesRequest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
HOT = {"temperature": 5.0}  # far from greedy: only a filter that keeps one token gives the greedy answer
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
          "additionalProperties": False}
WEATHER_TOOL = {"name": "get_weather", "description": "Weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                 "required": ["city"]}}


def png() -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def text(out: dict) -> str:
    return "".join(b.get("text", "") for b in out["content"] if b["type"] == "text")


def inputs(out: dict) -> int:
    return out["usage"]["input_tokens"] + out["usage"]["cache_read_input_tokens"]


@dataclass
class Case:
    """``extra`` replaces fields of the baseline body; ``check(out, base)`` on the answer, or
    ``refused``: the 400's field (``param``, default the case's field)."""

    field: str
    extra: dict[str, Any]
    check: Callable[[dict, dict], bool] | None = None
    param: str | None = None
    server: str = "tp1"
    twin: dict[str, Any] | None = None  # another body whose answer the check gets as out["twin"]


CASES = [
    Case("model", {"model": "no-such-model"}, None),
    Case("messages", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                                   *QUESTION]}, lambda o, b: inputs(o) > inputs(b)),
    Case("messages", {"messages": []}, None),
    Case("messages", {"messages": [*QUESTION, {"role": "system", "content": "Answer in French, in capitals."}]},
         lambda o, b: text(o) != text(b)),  # a system turn where it stands (or folded into the user turn)
    Case("messages", {"messages": [*QUESTION, {"role": "system", "content": [{"type": "image", "source": {}}]}]},
         None, "messages.1.content.0.type"),
    Case("messages", {"messages": [{"role": "user", "content": []}]}, None, "messages.0.content"),
    Case("messages", {"messages": [{"role": "tool", "content": "x"}]}, None, "messages.0.role"),
    Case("messages", {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, None, "messages.0.name"),
    Case("messages", {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, None,
         "messages.0.content.0.type"),
    Case("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]},
         None, "messages.0.content.0.citations"),
    Case("messages", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}]},
         None, "messages.0.content.0.source.type"),
    Case("messages", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png()}}]}]},
         None, "messages.0.content.0"),  # the default model has no vision tower
    Case("messages", {"messages": [*QUESTION, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, None, "messages.1.content.0.type"),
    Case("max_tokens", {"max_tokens": 3}, lambda o, b: o["usage"]["output_tokens"] == 3),
    Case("max_tokens", {"max_tokens": 0}, None),
    Case("system", {"system": "Answer in French."}, lambda o, b: text(o) != text(b)),
    # Claude Code's billing block is dropped: the prompt is the one of the other blocks alone.
    Case("system", {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=81f3;"},
                               {"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}}]},
         lambda o, b: text(o) != text(b) and inputs(o) == inputs(o["twin"]), twin={"system": "Answer in French."}),
    Case("system", {"system": [{"type": "image", "source": {}}]}, None, "system.0.type"),
    Case("stop_sequences", {"stop_sequences": ["Paris"]},
         lambda o, b: o["stop_reason"] == "stop_sequence" and o["stop_sequence"] == "Paris"),
    Case("stream", {"stream": True}, lambda o, b: o["streamed"] and o["text"] == text(b)),
    Case("temperature", HOT, lambda o, b: text(o) != text(b)),
    Case("top_p", {**HOT, "top_p": 1e-9}, lambda o, b: text(o) == text(b)),
    Case("top_k", {**HOT, "top_k": 1}, lambda o, b: text(o) == text(b)),
    Case("metadata", {"metadata": {"user_id": "walker-bob"}}, lambda o, b: o["log_has_user"]),
    Case("metadata", {"metadata": {"plan": "pro"}}, None, "metadata.plan"),
    Case("tools", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "any"}, "max_tokens": 60},
         lambda o, b: o["content"][-1]["type"] == "tool_use", server="tiny"),
    Case("tools", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, None, "tools.0.type"),
    Case("tools", {"tools": [{**WEATHER_TOOL, "strict": True}]}, None, "tools.0.strict"),
    Case("tools", {"tools": [{**WEATHER_TOOL, "input_examples": [{"city": "Oslo"}]}]}, None, "tools.0.input_examples"),
    Case("tools", {"tools": [{**WEATHER_TOOL, "input_schema": {"type": "string"}}]}, None, "tools.0.input_schema"),
    Case("tool_choice", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "get_weather"},
                         "max_tokens": 60},
         lambda o, b: [c["name"] for c in o["content"] if c["type"] == "tool_use"] == ["get_weather"], server="tiny"),
    Case("tool_choice", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "sometimes"}}, None, "tool_choice.type"),
    Case("tool_choice", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, None),
    Case("thinking", {"thinking": {"type": "enabled", "budget_tokens": 100}},  # no thinking markers: no effect,
         lambda o, b: text(o) == text(b) and o["ignored"] == "thinking"),    # said in the header
    Case("thinking", {"thinking": {"type": "adaptive", "display": "updates"}, "output_config": {"effort": "high"}},
         lambda o, b: text(o) == text(b) and o["ignored"] == "thinking, output_config.effort"),
    Case("thinking", {"thinking": {"type": "disabled"}}, lambda o, b: text(o) == text(b)),
    Case("thinking", {"thinking": {"type": "between_tools"}}, None, "thinking.type"),
    Case("output_config", {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}, "max_tokens": 40},
         lambda o, b: set(json.loads(text(o))) == {"city"}),
    Case("output_config", {"output_config": {"effort": "high"}},
         lambda o, b: text(o) == text(b) and o["ignored"] == "output_config.effort"),
    Case("output_config", {"output_config": {"effort": "extreme"}}, None, "output_config.effort"),
    Case("output_config", {"output_config": {"verbosity": "low"}}, None, "output_config.verbosity"),
    Case("output_format", {"output_format": {"type": "json_schema", "schema": SCHEMA}, "max_tokens": 40},
         lambda o, b: set(json.loads(text(o))) == {"city"}),
    Case("cache_control", {"cache_control": {"type": "ephemeral"}}, lambda o, b: text(o) == text(b)),
    Case("cache_control", {"cache_control": {"type": "forever"}}, None, "request.cache_control"),
    Case("service_tier", {"service_tier": "standard_only"}, lambda o, b: text(o) == text(b)),
    Case("service_tier", {"service_tier": "priority"}, None),
    Case("speed", {"speed": "fast"}, None),
    Case("container", {"container": "container_1"}, None),
    Case("context_management", {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
         lambda o, b: text(o) == text(b) and o["context_management"] == {"applied_edits": []}),  # below its trigger
    Case("context_management", {"context_management": {"edits": []}},
         lambda o, b: o["context_management"] == {"applied_edits": []}),
    Case("context_management", {"context_management": {"edits": [{"type": "clear_everything"}]}}, None,
         "context_management.edits.0.type"),
    Case("context_management", {"messages": ["not a message", *QUESTION], "context_management": {"edits": [
        {"type": "clear_thinking_20251015"}, {"type": "clear_tool_uses_20250919",
                                              "trigger": {"type": "input_tokens", "value": 0}}]}}, None, "messages[0]"),
    Case("safeguards", {"safeguards": [{"type": "dangerous_tool_use", "classifier_context": {"v": 1}}]},
         lambda o, b: text(o) == text(b) and o["ignored"] == "safeguards"),
    Case("mcp_servers", {"mcp_servers": [{"type": "url", "url": "http://127.0.0.1:9", "name": "x"}]}, None),
    Case("diagnostics", {"diagnostics": {"previous_message_id": "msg_1"}}, None),
    Case("inference_geo", {"inference_geo": "us"}, None),
    Case("user_profile_id", {"user_profile_id": "up_1"}, None),
    Case("workspace_id", {"workspace_id": "wrkspc_1"}, None),
    Case("compaction", {"compaction": {"type": "auto"}}, None),
    Case("fallbacks", {"fallbacks": [{"model": "other"}]}, None),
    Case("fallback_credit_token", {"fallback_credit_token": "t"}, None),
    Case("billing_policy", {"billing_policy": {"type": "x"}}, None),
    Case("thread", {"thread": {"id": "t"}}, None),
    Case("frobnicate", {"frobnicate": 1}, None),
]


def test_the_walk_covers_every_field():
    assert set(MessagesRequest.__struct_fields__) - {c.field for c in CASES} == set()


def post(server, body: dict) -> httpx.Response:
    if not body.get("stream"):
        return httpx.post(f"{server.url}/v1/messages", json=body, timeout=300)
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=300) as r:
        r.read()
    return r


@pytest.fixture(scope="module")
def baselines() -> dict:
    return {}


@pytest.mark.parametrize("case", CASES, ids=[f"{c.field}-{i}" for i, c in enumerate(CASES)])
def test_the_field_is_honoured_or_refused_by_name(tp1, tiny, baselines, case):
    server, model = {"tp1": (tp1, DEFAULT_MODEL), "tiny": (tiny, TINY)}[case.server]
    base_body = {"model": model, "max_tokens": 8, "temperature": 0, "messages": QUESTION}
    if case.server not in baselines:
        baselines[case.server] = post(server, base_body).json()
    body = {**base_body, **case.extra}
    r = post(server, body)
    if case.check is None:
        status = 404 if case.field == "model" else 400
        assert r.status_code == status, r.text
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == ("not_found_error" if status == 404
                                                                         else "invalid_request_error")
        assert error["error"]["message"].startswith(f"{case.param or case.field}:"), error
        return
    assert r.status_code == 200, r.text
    if body.get("stream"):
        out = {"streamed": True, "text": "".join(json.loads(line[6:])["delta"].get("text", "")
                                                  for line in r.text.splitlines()
                                                  if line.startswith("data: ") and "text_delta" in line)}
    else:
        out = r.json()
    out["ignored"] = r.headers.get("x-neuron-ignored")
    if case.twin is not None:
        out["twin"] = post(server, {**base_body, **case.twin}).json()
    if case.field == "metadata":
        out["log_has_user"] = "user=walker-bob" in server.log()
    assert case.check(out, baselines[case.server]), f"{json.dumps(out)[:600]}"
