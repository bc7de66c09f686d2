"""Anthropic's Messages API request, and the chat request it runs as. The body is a msgspec Struct
that refuses unknown fields (as Anthropic's API does); the translation maps system blocks to the
system message, content blocks to chat content, ``tool_use`` / ``tool_result`` blocks to tool
calls and tool messages, tools and ``tool_choice`` to their chat forms, ``thinking`` and
``output_config.effort`` to the template's thinking switch and a thinking budget, and
``output_config.format`` to ``response_format``; ``context_management``'s edits are applied to the
messages first (``context_edits``). What neuron cannot honour is a 400 naming it, except what every
Claude client sends by default and has no effect on this model (thinking and effort on a model
that does not think, ``safeguards``): those are answered, and named in the ``x-neuron-ignored``
header and the request's log line (``Translation.ignored``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from neuron.loader.template_worker import TemplateRenderer
from neuron.loader.tokenizer import encode_ids
from protocol.engine_client import ModelView
from neuron.parsing.reasoning import reasoning_markers

from neuron.server.messages.content import bad, chat_messages, check_cache_control, only_keys, unset
from neuron.server.messages.context_edits import apply_edits
from neuron.server.messages.system_turns import place_system
from neuron.server.schemas import ChatRequest


class CountTokensRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``/v1/messages/count_tokens``: what shapes the prompt."""

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's output_config.format
    cache_control: dict[str, Any] | None = None  # served by the automatic prefix cache
    # Anthropic's, refused when given (REFUSED).
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    mcp_servers: list[Any] | None = None
    context_management: Any = None  # its edits are applied (context_edits.py)
    safeguards: Any = None  # Claude Code's input to Anthropic's classifiers: answered without, and named


class MessagesRequest(CountTokensRequest, forbid_unknown_fields=True, kw_only=True):
    """``/v1/messages``."""

    max_tokens: int
    stream: bool | None = False
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # Anthropic's, refused when given (REFUSED).
    container: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    compaction: Any = None
    fallbacks: Any = None
    fallback_credit_token: Any = None
    billing_policy: Any = None
    thread: Any = None


# field -> (does this value ask for nothing we lack?, why we refuse it otherwise)
REFUSED = {
    "speed": (lambda v: v in (None, "standard"), "there is one speed: 'standard'"),
    "user_profile_id": (unset, "user profiles are not supported; metadata.user_id names the user in logs"),
    "workspace_id": (unset, "workspaces are not supported"),
    "mcp_servers": (unset, "MCP servers are not connected by neuron: run the tools in the client"),
    "container": (unset, "code-execution containers are not supported"),
    "diagnostics": (unset, "cache diagnostics are not supported"),
    "inference_geo": (unset, "there is one place of inference: this server"),
    "compaction": (unset, "server-side compaction is not supported"),
    "fallbacks": (unset, "fallback models are not supported"),
    "fallback_credit_token": (unset, "fallback models are not supported"),
    "billing_policy": (unset, "billing policies are not supported"),
    "thread": (unset, "message threads are not supported"),
    "service_tier": (lambda v: v in (None, "auto", "standard_only"), "the service tier must be 'auto' or "
                     "'standard_only'"),
}

# What output_config.effort bounds thinking to, for a model whose template has no effort setting.
EFFORT_BUDGET = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768, "max": None}


@dataclass
class Translation:
    """The chat request, where its messages came from (to name the Anthropic field in an error
    the chat path raises), and what the view needs."""

    chat: ChatRequest
    origin: dict[str, str] = field(default_factory=dict)  # "messages.3.content.1" (chat) -> Anthropic's path
    show_thinking: bool = True
    ignored: list[str] = field(default_factory=list)  # fields given that had no effect on this model
    applied_edits: list[dict[str, Any]] | None = None  # context_management's, when it was given


# ----------------------------------------------------------------------------- tools, thinking, output

TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict", "input_examples",
             "defer_loading", "eager_input_streaming", "allowed_callers"}


def _tools(raw: list[dict[str, Any]] | None, forced: bool) -> list[dict[str, Any]] | None:
    """Client tools as chat tools. Server tools (web search, code execution, ...) run on
    Anthropic's side: neuron refuses them by name."""
    if raw is None:
        return None
    out = []
    for i, tool in enumerate(raw):
        param = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad("a tool must be an object", param)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad(f"server tools ({str(kind)[:40]!r}) are not run by neuron: define the tool with a name and "
                      "an input_schema and run it in the client", f"{param}.type")
        only_keys(tool, TOOL_KEYS, param)
        check_cache_control(tool, param)
        if tool.get("defer_loading") is True:  # not loaded into the context until a tool search finds
            continue  # it, and tool search is Anthropic's server tool: here it stays out of the prompt
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise bad("input_schema must be a JSON schema of type 'object'", f"{param}.input_schema")
        if tool.get("strict") and not forced:
            raise bad("strict: tool inputs follow their schema only when tool_choice is 'any' or 'tool'",
                      f"{param}.strict")
        for key, why in (("input_examples", "input examples are not supported: put them in the description"),
                         ("allowed_callers", "programmatic tool calling is not supported")):
            if not unset(tool.get(key)) and tool.get(key) is not False:
                raise bad(why, f"{param}.{key}")
        function = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(raw: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict):
        raise bad("tool_choice must be an object with a type", "tool_choice")
    only_keys(raw, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    parallel = False if raw.get("disable_parallel_tool_use") else None
    kind = raw.get("type")
    if kind == "tool":
        if not isinstance(raw.get("name"), str):
            raise bad("tool_choice of type 'tool' needs the tool's name", "tool_choice.name")
        return {"type": "function", "function": {"name": raw["name"]}}, parallel
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if choice is None:
        raise bad("tool_choice.type must be auto, any, tool or none", "tool_choice.type")
    return choice, parallel


@dataclass
class Thinking:
    kwargs: dict[str, Any] = field(default_factory=dict)  # the template's switch
    budget: int | None = None
    effort: str | None = None  # for a template that reads reasoning_effort
    show: bool = True
    ignored: list[str] = field(default_factory=list)  # given, and of no effect on this model


def _thinking(body: CountTokensRequest, handle: ModelView) -> Thinking:
    """``thinking`` and ``output_config.effort`` on this model: its template's ``enable_thinking``
    switch where it has one, else (a model that always thinks) a budget of 0 to turn it off; the
    budget from ``budget_tokens``, or from the effort."""
    template = handle.spec.tokenizer.chat_template or ""
    thinks = reasoning_markers(getattr(handle.entry, "reasoning_parser", "auto"), template) is not None
    switch = "enable_thinking" in template
    out = Thinking()
    raw = body.thinking
    kind = None
    if raw is not None:
        if not isinstance(raw, dict):
            raise bad("thinking must be an object with a type", "thinking")
        only_keys(raw, {"type", "budget_tokens", "display"}, "thinking")
        kind = raw.get("type")
        if raw.get("display") not in (None, "summarized", "omitted", "updates"):
            raise bad("thinking.display must be summarized, updates or omitted", "thinking.display")
        out.show = raw.get("display") != "omitted"
        if kind in ("enabled", "adaptive"):
            if not thinks:  # every Claude client asks for it: answered without thinking, and said so
                out.ignored.append("thinking")
            elif switch:
                out.kwargs["enable_thinking"] = True
        elif kind == "disabled":
            if switch:
                out.kwargs["enable_thinking"] = False
            elif thinks:
                out.budget = 0
        else:
            raise bad("thinking.type must be enabled, adaptive or disabled", "thinking.type")
        budget = raw.get("budget_tokens")
        if kind == "enabled":
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise bad("budget_tokens must be a whole number of tokens", "thinking.budget_tokens")
            out.budget = budget if thinks else None
        elif budget is not None:
            raise bad(f"thinking of type {kind!r} takes no budget_tokens", "thinking.budget_tokens")
    config = body.output_config or {}
    only_keys(config, {"effort", "format"}, "output_config")
    effort, where = config.get("effort"), "output_config.effort"
    turn = turn_effort(body.messages)
    if turn is not None:
        effort, where = turn
    if effort is not None:
        if effort not in EFFORT_BUDGET:
            raise bad(f"effort must be one of {', '.join(EFFORT_BUDGET)}", where)
        if "reasoning_effort" in template:
            out.effort = {"xhigh": "high", "max": "high"}.get(effort, effort)
        elif not thinks or kind == "disabled":  # how long the model thinks: it does not, here
            out.ignored.append(where)
        elif out.budget is None:
            out.budget = EFFORT_BUDGET[effort]
    return out


def turn_effort(messages: list[Any]) -> tuple[str, str] | None:
    """The last turn's own ``output_config.effort`` (Claude Code's per-turn control), with its
    path: it sets the effort from that turn on, so the answer's."""
    found = None
    for i, message in enumerate(messages):
        config = message.get("output_config") if isinstance(message, dict) else None
        if config is None:
            continue
        if not isinstance(config, dict):
            raise bad("a turn's output_config must be an object", f"messages.{i}.output_config")
        only_keys(config, {"effort"}, f"messages.{i}.output_config")
        if config.get("effort") is not None:
            found = (config["effort"], f"messages.{i}.output_config.effort")
    return found


def _format(body: CountTokensRequest) -> dict[str, Any] | None:
    fmt = (body.output_config or {}).get("format")
    param = "output_config.format"
    if body.output_format is not None:
        if fmt is not None:
            raise bad("give output_config.format or output_format, not both", "output_format")
        fmt, param = body.output_format, "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad("the format must be {\"type\": \"json_schema\", \"schema\": {...}}", param)
    only_keys(fmt, {"type", "schema"}, param)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# ----------------------------------------------------------------------------- the chat request

# What the chat request calls the fields of this one.
CHAT_NAMES = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "stop": "stop_sequences",
              "response_format": "output_config.format", "thinking_token_budget": "thinking.budget_tokens",
              "chat_template_kwargs": "thinking", "reasoning_effort": "output_config.effort",
              "parallel_tool_calls": "tool_choice.disable_parallel_tool_use", "user": "metadata.user_id",
              "continue_final_message": "messages", "add_generation_prompt": "messages"}


def translate(body: CountTokensRequest, handle: ModelView, templates: TemplateRenderer) -> Translation:
    """The chat request ``body`` runs as (on ``handle``'s template); every refusal names the
    Anthropic field."""
    for name, (fine, why) in REFUSED.items():
        if hasattr(body, name) and not fine(getattr(body, name)):
            raise bad(f"{name}: {why}", name)
    if body.cache_control is not None:
        check_cache_control({"cache_control": body.cache_control}, "request")
    tokenizer = handle.spec.tokenizer.tokenizer

    def tokens(text: str) -> int:
        return len(encode_ids(tokenizer, text, False))

    def total(edited: list[dict[str, Any]]) -> int:
        return tokens(json.dumps([body.system, edited, body.tools], ensure_ascii=False))

    raw_messages, applied = apply_edits(body.context_management, body.messages, tokens, total)
    origin: dict[str, str] = {}
    messages = place_system(chat_messages(body.system, raw_messages, origin), origin, handle, templates)
    tool_choice, parallel = _tool_choice(body.tool_choice)
    tools = _tools(body.tools, forced=tool_choice == "required" or isinstance(tool_choice, dict))
    thinking = _thinking(body, handle)
    last = messages[-1]
    prefill = last["role"] == "assistant"
    if prefill and (last.get("tool_calls") or not isinstance(last.get("content"), str) or not last["content"]):
        raise bad("a final assistant message is a prefill: it must hold text only",
                  origin.get(f"messages.{len(messages) - 1}", "messages"))
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "tools": tools, "tool_choice": tool_choice,
        "parallel_tool_calls": parallel, "chat_template_kwargs": thinking.kwargs or None,
        "thinking_token_budget": thinking.budget, "reasoning_effort": thinking.effort,
        "response_format": _format(body), "add_generation_prompt": not prefill, "continue_final_message": prefill,
    }
    if isinstance(body, MessagesRequest):
        if body.max_tokens < 1:
            raise bad("max_tokens must be at least 1 (warming the cache with 0 is not supported)", "max_tokens")
        metadata = body.metadata or {}
        only_keys(metadata, {"user_id"}, "metadata")
        chat.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                    top_p=body.top_p, top_k=body.top_k, stream=body.stream, user=metadata.get("user_id"))
    try:
        request = msgspec.convert(chat, ChatRequest)
    except msgspec.ValidationError as exc:
        raise bad(f"invalid request: {exc}", "messages") from None
    ignored = thinking.ignored + (["safeguards"] if not unset(body.safeguards) else [])
    return Translation(request, origin, thinking.show, ignored, applied)


def our_name(param: str | None, origin: dict[str, str]) -> str | None:
    """The Anthropic field of a field the chat path named."""
    if param is None:
        return None
    if param.startswith("messages."):
        pieces = param.split(".")
        for n in (4, 2):
            if ".".join(pieces[:n]) in origin:
                return origin[".".join(pieces[:n])]
        return "messages"
    if param.startswith("tools."):
        return param.replace(".function.parameters", ".input_schema").replace(".function", "")
    head, dot, rest = param.partition(".")
    if head in ("tool_choice", "response_format"):
        return CHAT_NAMES.get(head, head)
    return CHAT_NAMES.get(head, head) + dot + rest
