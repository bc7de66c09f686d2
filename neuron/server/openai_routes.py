"""``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from neuron.engine.request import Event, FinishEvent, GenRequest, TokenEvent
from neuron.errors import ApiError
from neuron.registry import ModelHandle

from .errors import envelope
from .request_id import request_id
from .request_trace import RequestTrace, log_start, log_unserved
from .requests import chat_prompt, completion_prompt, make_request, read_json
from .schemas import ChatRequest, CompletionRequest, SamplingFields
from .state import AppState, require_key
from .views import ChatView, CompletionView, View

T = TypeVar("T")
B = TypeVar("B", bound=SamplingFields)
KEEPALIVE_S = 1.0


def _serving(state: AppState, model: str) -> ModelHandle:
    if state.draining:
        raise ApiError(503, "shutting_down", "the server is shutting down")
    handle = state.registry.get(model)
    if handle.status != "loaded":
        raise ApiError(503, "model_unavailable", f"model {model!r} is {handle.status}", retry_after=5)
    return handle


async def chat_completions(request: Request) -> Response:
    def top(body: ChatRequest) -> tuple[int | None, str]:
        return ((body.top_logprobs or 0) if body.logprobs else None), "top_logprobs"

    return await _complete(request, ChatRequest, chat_prompt, ChatView, top)


async def completions(request: Request) -> Response:
    def top(body: CompletionRequest) -> tuple[int | None, str]:
        return body.logprobs, "logprobs"

    return await _complete(request, CompletionRequest, completion_prompt, CompletionView, top)


async def _complete(request: Request, kind: type[B], build_prompt: Callable[[B, ModelHandle], list[int]],
                    view_kind: type[View], top_of: Callable[[B], tuple[int | None, str]]) -> Response:
    """The one path of both completion routes: validate, tokenize, submit, respond."""
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=False)
    body = await read_json(request, kind, state.cfg.server.max_body_bytes)
    handle = _serving(state, body.model)
    top, param = top_of(body)
    if top is not None and not 0 <= top <= 20:
        raise ApiError(400, "invalid_request", f"{param} must be in [0, 20]", param=param)
    # Templating and tokenizing a long prompt takes a while: keep it off the event loop.
    prompt = await asyncio.to_thread(build_prompt, body, handle)
    req = make_request(body, handle, prompt, 0 if top is None else top + 1)
    view = view_kind(model=handle.id, tokenizer=handle.spec.tokenizer.tokenizer, top_logprobs=top,
                     return_token_ids=body.return_token_ids)
    return await _respond(request, state, handle, req, view, body.stream,
                          bool(body.stream_options and body.stream_options.include_usage))


async def list_models(request: Request) -> Response:
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=False)
    data = [{"id": h.id, "object": "model", "created": 0, "owned_by": "neuron",
             "max_model_len": h.max_len, "status": h.status} for h in state.registry.models.values()]
    return JSONResponse({"object": "list", "data": data})


async def _unless_disconnected(request: Request, aw: Awaitable[T], req: GenRequest, handle: ModelHandle) -> T:
    """Await ``aw``; if the client goes away first, abort the request and raise CancelledError."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                handle.engine.abort(req)
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()


async def _respond(request: Request, state: AppState, handle: ModelHandle, req: GenRequest, view: View,
                   stream: bool, include_usage: bool) -> Response:
    trace = RequestTrace(request_id(request), handle.id, request.url.path)
    trace.attach(req)
    log_start(trace, req, stream)
    try:
        handle.engine.submit(req)
    except ApiError as exc:
        log_unserved(trace, "refused", exc.status, exc.code)
        raise
    state.metrics.request_started(handle.id)
    try:
        await _unless_disconnected(request, asyncio.shield(req.admitted), req, handle)
    except asyncio.CancelledError:
        log_unserved(trace, "abort", 499, "client_disconnected")
        return Response(status_code=499)
    except ApiError as exc:
        handle.engine.abort(req)
        log_unserved(trace, "refused", exc.status, exc.code)
        raise
    if stream:
        return StreamingResponse(_sse(handle, req, view, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        events, fin = await _unless_disconnected(request, _collect(req), req, handle)
    except asyncio.CancelledError:
        return Response(status_code=499)
    if fin.error is not None:
        code = "insufficient_memory" if fin.error_kind == "oom" else "model_unavailable"
        raise ApiError(503, code, fin.error, retry_after=5)
    text = "".join(ev.text for ev in events)
    return JSONResponse(view.whole(text, events, fin))


async def _collect(req: GenRequest) -> tuple[list[TokenEvent], FinishEvent]:
    events: list[TokenEvent] = []
    while True:
        ev = await req.events.get()
        if isinstance(ev, FinishEvent):
            return events, ev
        events.append(ev)


_encode = msgspec.json.Encoder().encode


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


async def _next_event(events: asyncio.Queue) -> Event | None:
    """The next event of a request, or None after KEEPALIVE_S without one."""
    if not events.empty():
        return events.get_nowait()
    try:
        async with asyncio.timeout(KEEPALIVE_S):
            return await events.get()
    except TimeoutError:
        return None


async def _sse(handle: ModelHandle, req: GenRequest, view: View, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        first = view.first()
        if first is not None:
            yield _data(first)
        held: Event | None = None
        while True:
            ev, held = held, None
            if ev is None:
                ev = await _next_event(req.events)
            if ev is None:
                yield b": keep-alive\n\n"
                continue
            # Tokens that queued up while the loop was busy go out in one chunk.
            while isinstance(ev, TokenEvent) and not req.events.empty():
                more = req.events.get_nowait()
                if not isinstance(more, TokenEvent):
                    held = more
                    break
                ev = TokenEvent(ev.text + more.text, ev.token_ids + more.token_ids,
                                (ev.logprobs or []) + (more.logprobs or []) or None)
            if isinstance(ev, TokenEvent):
                chunk = view.delta(ev)
                if chunk is not None:
                    yield _data(chunk)
                continue
            yield _data(view.finish(ev))
            if ev.error is not None:
                code = "insufficient_memory" if ev.error_kind == "oom" else "model_unavailable"
                yield _data(envelope(ApiError(503, code, ev.error)))
            if include_usage:
                yield _data(view.usage_chunk(ev))
            yield b"data: [DONE]\n\n"
            return
    finally:
        handle.engine.abort(req)
