"""``/v1/responses``: OpenAI's Responses API over the chat machinery. The request becomes a chat
request (input items to messages, ``instructions`` to the system message, ``text.format`` to
``response_format``, function tools to chat tools), the earlier turns of ``previous_response_id``
come from an in-memory LRU store, and the choice's deltas become response events (streamed) or
the response object (whole) through one state machine."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuron.errors import ApiError

from neuron.server.openai.choices import Choice, Delta
from neuron.server.openai.generation import KEEPALIVE, respond, usage
from neuron.server.openai.routes import serving
from neuron.server.openai.planning import plan_chat
from neuron.server.sse import json_text
from neuron.server.openai.prompts import IMAGE_PARTS
from neuron.server.openai.requests import decode_json, read_body
from neuron.server.openai.response_store import ResponseStore
from neuron.server.schemas import ChatRequest
from neuron.server.state import AppState, require_key
from neuron.parsing.tool_calls import CallStart
from neuron.server.openai.views import Folded


def _bad(message: str, param: str) -> ApiError:
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
                raise _bad("only text and image content parts are supported", f"{param}.{i}.type")
            parts.append({"type": "text", "text": str(part.get("text") or "")})
        if all(part["type"] == "text" for part in parts):
            return "".join(part["text"] for part in parts)
        return parts
    raise _bad("content must be a string or a list of text and image parts", param)


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
                raise _bad("a message's role must be user, system, developer or assistant", f"{param}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if not isinstance(call["function"]["name"], str) or not isinstance(call["id"], str):
                raise _bad("a function_call item needs call_id and name", param)
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
            raise _bad(f"input items of type {str(kind)[:40]!r} are not supported", f"{param}.type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad("only function tools are supported", f"tools.{i}.type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                      if tool.get(k) is not None}})
    return out


def as_chat(body: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The chat request this response runs as, and its conversation (kept for the next turn)."""
    conversation = history + input_messages(body.input)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    fmt = (body.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise _bad("text.format must be an object", "text.format")
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
        raise _bad(f"invalid request: {exc}", "input") from None
    return chat, conversation


def _chat_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: fmt.get(k) for k in ("name", "schema", "strict")}}


# ----------------------------------------------------------------------------- the response


class ResponseView:
    """The Responses wire format over one choice's deltas (a StreamView): output items appear as
    their first text arrives (reasoning, message, function calls), their deltas stream, and each
    is done before the next begins. The same machine builds the whole response object."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.request = body
        self.id = f"resp_{body.request_id or uuid.uuid4().hex}"
        self.model = model
        self.created = time.time()
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.reason: str | None = None
        self.messages: list[dict[str, Any]] = []  # this turn's output as chat messages
        self.final: dict[str, Any] | None = None

    # StreamView
    def opening(self, choices: list[Choice]) -> list[str]:
        shell = self.response(choices, "in_progress")
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def frames(self, delta: Delta, choices: list[Choice]) -> list[str]:
        out: list[str] = []
        if delta.reasoning:
            out += self._write("reasoning", delta.reasoning)
        if delta.content:
            out += self._write("message", delta.content)
        for ev in delta.calls:
            if isinstance(ev, CallStart):
                out += self._close()
                item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": ev.id,
                        "name": ev.name, "arguments": "", "status": "in_progress"}
                out += self._add(item)
            elif self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += ev.text
                out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                       output_index=len(self.output) - 1, delta=ev.text))
        if delta.reason is not None:
            self.reason = delta.reason
            out += self._close()
        return out

    def closing(self, choices: list[Choice], failed: ApiError | None) -> list[str]:
        if failed is not None:
            final = self.response(choices, "failed")
            final["error"] = {"code": failed.code, "message": failed.message}
            return [self._event("response.failed", response=final)]
        final = self.finish(choices)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [self._event(kind, response=final)]

    def keepalive(self) -> bytes:
        return KEEPALIVE

    def body(self, folded: list[Folded], choices: list[Choice]) -> dict[str, Any]:
        self.frames(folded[0].as_delta(), choices)
        return self.finish(choices)

    # the machine
    def _event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        return f"event: {kind}\ndata: {json_text(payload)}\n\n"

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.output.append(item)
        self.open = item
        out = [self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)]
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.output) - 1, content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _write(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            if kind == "message":
                out += self._add({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "role": "assistant",
                                  "status": "in_progress", "content": [{"type": "output_text", "text": "",
                                                                        "annotations": []}]})
            else:
                out += self._add({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [],
                                  "content": [{"type": "reasoning_text", "text": ""}]})
        item, index = self.open, len(self.output) - 1
        assert item is not None
        item["content"][0]["text"] += text
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return out + [self._event(event, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)]

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output) - 1
        out: list[str] = []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=item["content"][0])]
            item["status"] = "completed"
            self.messages.append({"role": "assistant", "content": text})
        elif item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=item["content"][0]["text"]))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, arguments=item["arguments"], name=item["name"]))
            item["status"] = "completed"
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = self.messages[-1] if self.messages else None
            if last is not None and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                self.messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return out + [self._event("response.output_item.done", output_index=index, item=item)]

    def response(self, choices: list[Choice], status: str) -> dict[str, Any]:
        b = self.request
        u = usage(choices)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": self.output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature, "top_p": b.top_p, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto", "tools": b.tools or [],
            "text": b.text or {"format": {"type": "text"}}, "previous_response_id": b.previous_response_id,
            "store": b.store is not False, "metadata": b.metadata or {}, "user": b.user,
            "reasoning": b.reasoning, "truncation": "disabled", "background": False,
            "usage": {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                      "total_tokens": u.prompt_tokens + u.completion_tokens,
                      "input_tokens_details": {"cached_tokens": u.cached_tokens},
                      "output_tokens_details": {"reasoning_tokens": 0}},
        }

    def finish(self, choices: list[Choice]) -> dict[str, Any]:
        self._close()
        status = "incomplete" if self.reason == "length" else "completed"
        final = self.response(choices, status)
        final["completed_at"] = time.time()
        self.final = final
        return final


# ----------------------------------------------------------------------------- the route

# What the chat request calls the fields of this one.
_CHAT_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning"}


def _our_name(param: str | None) -> str | None:
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    return _CHAT_NAMES.get(head, head) + dot + rest


async def create_response(request: Request) -> Response:
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=False)
    data = await read_body(request, state.cfg.server.max_body_bytes)
    async with state.body_budget.hold(len(data)) as run:
        body = decode_json(data, ResponsesRequest)
        handle = serving(state, body.model)
        for name, (fine, why) in REFUSED.items():
            if not fine(getattr(body, name)):
                raise _bad(f"{name}: {why}", name)
        if body.max_tool_calls is not None and not 0 <= body.max_tool_calls < 2**31:
            raise _bad("max_tool_calls must be in [0, 2^31)", "max_tool_calls")
        store: ResponseStore = state.responses
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            found = await store.fetch(body.previous_response_id)
            if found is None:
                raise ApiError(404, "not_found", f"no stored response {body.previous_response_id!r}",
                               param="previous_response_id")
            history = list(found[0])
        try:
            chat, conversation = as_chat(body, history)
            _, build = await run(plan_chat, chat, handle, None, state.compiler, state.templates)
        except ApiError as exc:
            exc.param = _our_name(exc.param)
            raise
    choices = build()
    if body.max_tool_calls is not None and choices[0].tools is not None:
        choices[0].tools.max_calls = body.max_tool_calls
    view = ResponseView(body, handle.id)
    response = await respond(request, state, handle, choices, view, bool(body.stream))
    if body.store is not False:
        _store_when_done(response, store, view, conversation)
    return response


def _store_when_done(response: Response, store: ResponseStore, view: ResponseView,
                     conversation: list[dict[str, Any]]) -> None:
    """Keep the turn once its output is complete: now for a whole response, at the stream's end."""
    def keep() -> None:
        if view.final is not None:
            store.put(view.id, conversation + view.messages, view.final)

    if isinstance(response, JSONResponse):
        keep()
        return
    iterator = getattr(response, "body_iterator", None)
    if iterator is None:
        return

    async def wrapped():
        kept = False
        try:
            async for frame in iterator:
                if not kept and view.final is not None:  # kept before its last frames reach the client
                    kept = True
                    keep()
                yield frame
        finally:
            if not kept:
                keep()

    response.body_iterator = wrapped()


async def get_response(request: Request) -> Response:
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=False)
    found = await state.responses.fetch(request.path_params["response_id"])
    if found is None:
        raise ApiError(404, "not_found", "no such stored response", param="response_id")
    return JSONResponse(found[1])

