"""A ``/v1/responses`` request and what it becomes: a chat request (input items to messages,
``instructions`` to the system message, ``text.format`` to ``response_format``, function tools to
chat tools) after the earlier turns of ``previous_response_id``. The route is ``responses.py``."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from neuron.errors import ApiError
from neuron.server.openai.prompts import IMAGE_PARTS
from neuron.server.schemas import ChatRequest


def bad_request(message: str, param: str) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


class ResponsesRequest(msgspec.Struct):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    service_tier: str | None = None
    prompt: Any = None
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None


REFUSED = {
    "background": (lambda v: not v, "background responses are not supported"),
    "prompt": (lambda v: v is None, "prompt templates are not supported"),
    "include": (lambda v: not v, "no extra output can be included"),
    "top_logprobs": (lambda v: not v, "logprobs are not supported on /v1/responses"),
    "truncation": (lambda v: v in (None, "disabled"), "only truncation 'disabled' is supported"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only the default service tier exists"),
}


# ----------------------------------------------------------------------------- the request


def _text(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: its text, or its parts where it holds images."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for i, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                url = part.get("image_url")
                parts.append({"type": "image_url", "image_url": url.get("url") if isinstance(url, dict) else url})
                continue
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise bad_request("only text and image content parts are supported", f"{param}.{i}.type")
            parts.append({"type": "text", "text": str(part.get("text") or "")})
        if all(part["type"] == "text" for part in parts):
            return "".join(part["text"] for part in parts)
        return parts
    raise bad_request("content must be a string or a list of text and image parts", param)


def input_messages(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: messages, earlier function calls (one assistant turn) and
    their outputs (tool turns). Earlier reasoning items are the model's own: left out."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        param = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request("a message's role must be user, system, developer or assistant", f"{param}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if not isinstance(call["function"]["name"], str) or not isinstance(call["id"], str):
                raise bad_request("a function_call item needs call_id and name", param)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"input items of type {str(kind)[:40]!r} are not supported", f"{param}.type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request("only function tools are supported", f"tools.{i}.type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                      if tool.get(k) is not None}})
    return out


def as_chat(body: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The chat request this response runs as, and its conversation (kept for the next turn)."""
    conversation = history + input_messages(body.input)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    fmt = (body.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    effort = (body.reasoning or {}).get("effort")
    try:
        chat = msgspec.convert({
            "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
            "tools": chat_tools(body.tools), "tool_choice": body.tool_choice,
            "parallel_tool_calls": body.parallel_tool_calls, "user": body.user, "request_id": body.request_id,
            "reasoning_effort": effort, "cache_salt": body.cache_salt, "priority": body.priority,
            "response_format": _chat_format(fmt) if fmt else None,
        }, ChatRequest)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid request: {exc}", "input") from None
    return chat, conversation


def _chat_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: fmt.get(k) for k in ("name", "schema", "strict")}}


# ----------------------------------------------------------------------------- the response
