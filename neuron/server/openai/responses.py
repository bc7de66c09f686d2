"""``/v1/responses``: OpenAI's Responses API over the chat machinery. The request becomes a chat
request (``responses_request.py``), the earlier turns of ``previous_response_id``
come from an in-memory LRU store, and the choice's deltas become response events (streamed) or
the response object (whole) through one state machine."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuron.errors import ApiError

from neuron.server.openai.choices import Choice, Delta
from neuron.server.chat_pipeline import ChatTurn, serve_chat
from neuron.server.openai.generation import KEEPALIVE, usage
from neuron.server.sse import json_text
from neuron.server.ignored import unknown_fields
from neuron.server.openai.requests import decode_json
from neuron.response_store import ResponseStore
from neuron.server.state import AppState, require_key
from protocol.engine_client import ModelView
from neuron.parsing.tool_calls import CallStart
from neuron.server.openai.views import Folded
from neuron.server.openai.responses_request import REFUSED, ResponsesRequest, as_chat, bad_request


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


async def _response_turn(request: Request, body: ResponsesRequest, handle: ModelView, data: bytes, run) -> ChatTurn:
    """The Responses API's adapter: the earlier turns of ``previous_response_id`` and the input as
    a chat, errors named as the body names them, the turn stored once its output is complete."""
    ignored = unknown_fields(data, ResponsesRequest)
    for name, (fine, why) in REFUSED.items():
        if not fine(getattr(body, name)):
            raise bad_request(f"{name}: {why}", name)
    if body.max_tool_calls is not None and not 0 <= body.max_tool_calls < 2**31:
        raise bad_request("max_tool_calls must be in [0, 2^31)", "max_tool_calls")
    store: ResponseStore = request.app.state.neuron.responses
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        found = await store.fetch(body.previous_response_id)
        if found is None:
            raise ApiError(404, "not_found", f"no stored response {body.previous_response_id!r}",
                           param="previous_response_id")
        history = list(found[0])
    try:
        chat, conversation = as_chat(body, history)
    except ApiError as exc:
        exc.param = _our_name(exc.param)
        raise
    view = ResponseView(body, handle.id)

    def made(plan, choices: list[Choice]) -> ResponseView:
        if body.max_tool_calls is not None and choices[0].tools is not None:
            choices[0].tools.max_calls = body.max_tool_calls
        return view

    def after(response: Response, choices: list[Choice]) -> None:
        if body.store is not False:
            _store_when_done(response, store, view, conversation)

    def rename(exc: ApiError) -> None:
        exc.param = _our_name(exc.param)

    return ChatTurn(chat, made, ignored, rename=rename, after=after)


async def create_response(request: Request) -> Response:
    return await serve_chat(request, ResponsesRequest, decode_json, _response_turn)


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

