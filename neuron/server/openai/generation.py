"""Running a response's choices on the engine and answering: submit every sequence, wait for
admission, then either stream the deltas as SSE chunks (interleaved as they come) or fold them
into one body. The client going away aborts every sequence."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from neuron.errors import ApiError
from protocol.engine_client import FinishEvent, ModelView

from neuron.server.openai.choices import Choice, Delta, Merged
from neuron.server.output.state import OutputState
from neuron.server.errors import envelope
from neuron.server.request_trace import RequestTrace, log_start, log_unserved
from neuron.server.sse import json_line
from neuron.server.state import AppState, principal_of
from neuron.server.openai.views import Folded, Usage, View

log = logging.getLogger("neuron.server")
T = TypeVar("T")
KEEPALIVE_S = 1.0
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment


def _unavailable(fin: FinishEvent) -> ApiError:
    code = {"oom": "insufficient_memory", "shutting_down": "shutting_down"}.get(fin.error_kind or "", "model_unavailable")
    return ApiError(503, code, fin.error or "generation failed", retry_after=5)


def abort_all(handle: ModelView, choices: list[Choice]) -> None:
    for c in choices:
        handle.client.abort(c.req)


async def until_disconnect(request: Request, aw: Awaitable[T], on_gone: Callable[[], None]) -> T:
    """Await ``aw``; if the client goes away first, call ``on_gone`` and raise CancelledError."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                on_gone()
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()
            # What it ends with (cancelled, or a refusal that came after all) is nobody's news.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def start(request: Request, state: AppState, handle: ModelView, choices: list[Choice], stream: bool,
                user: str | None = None) -> bool:
    """Submit every sequence and wait until all are admitted; False if the client left. Each
    sequence is traced under the request's id (its log lines, queue time, TTFT, ITL)."""
    submitted: list[OutputState] = []
    traces = [RequestTrace(c.req.request_id, handle.id, request.url.path) for c in choices]
    principal = principal_of(request)
    try:
        for c, trace in zip(choices, traces):
            trace.attach(c.req)
            log_start(trace, c.req, stream, user)
            try:
                handle.client.submit(c.req)
            except ApiError as exc:
                log_unserved(trace, "refused", exc.status, exc.code)
                state.metrics.request_rejected(principal.name, exc.code)
                raise
            state.metrics.request_started(handle.id)
            submitted.append(c.req)
        admitted = asyncio.gather(*(asyncio.shield(r.admitted) for r in submitted))
        await until_disconnect(request, admitted, lambda: abort_all(handle, choices))
    except asyncio.CancelledError:
        for trace in traces:
            log_unserved(trace, "abort", 499, "client_disconnected")
        return False
    except ApiError as exc:
        abort_all(handle, choices)
        for trace in traces[len(submitted):]:
            log_unserved(trace, "refused", exc.status, exc.code)
        if len(submitted) == len(choices):  # refused after it was queued: it waited too long
            state.metrics.request_rejected(principal.name, exc.code)
        raise
    return True


class StreamView(Protocol):
    """A wire format over the deltas: SSE frames while streaming, a body when whole."""

    def opening(self, choices: list[Choice]) -> list[str]: ...

    def frames(self, delta: Delta, choices: list[Choice]) -> list[str]: ...

    def closing(self, choices: list[Choice], failed: ApiError | None) -> list[str]: ...

    def body(self, folded: list[Folded], choices: list[Choice]) -> dict[str, Any]: ...

    def keepalive(self) -> bytes:
        """What a stream sends after a second without an event."""


@dataclass
class Chunks:
    """Chat and text completions as a StreamView: one ``data:`` chunk per delta, the usage chunk
    when asked, ``[DONE]``."""

    view: View
    include_usage: bool = False
    continuous_usage: bool = False

    def opening(self, choices: list[Choice]) -> list[str]:
        return [data(c) for c in self.view.first([c.index for c in choices],
                                                   {c.index: c.echo for c in choices if c.echo})]

    def frames(self, delta: Delta, choices: list[Choice]) -> list[str]:
        deltas = [delta]
        if delta.reasoning and (delta.content or delta.calls):
            # Thinking ended inside this piece: its end and the answer's start go in two chunks.
            deltas = [Delta(delta.index, reasoning=delta.reasoning),
                      replace(delta, reasoning="")]
        chunks = [self.view.chunk(d, usage(choices) if self.continuous_usage else None) for d in deltas]
        return [data(c) for c in chunks if c is not None]

    def closing(self, choices: list[Choice], failed: ApiError | None) -> list[str]:
        out = [data(envelope(failed))] if failed is not None else []
        if self.include_usage:
            out.append(data(self.view.usage_chunk(usage(choices))))
        return out + ["data: [DONE]\n\n"]

    def body(self, folded: list[Folded], choices: list[Choice]) -> dict[str, Any]:
        return self.view.whole(folded, usage(choices))

    def keepalive(self) -> bytes:
        return KEEPALIVE


async def respond(request: Request, state: AppState, handle: ModelView, choices: list[Choice], view: StreamView,
                  stream: bool, user: str | None = None) -> Response:
    if not await start(request, state, handle, choices, stream, user):
        return Response(status_code=499)
    if stream:
        return StreamingResponse(_sse(handle, choices, view), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        folded = await until_disconnect(request, collect(choices), lambda: abort_all(handle, choices))
    except asyncio.CancelledError:
        return Response(status_code=499)
    return JSONResponse(view.body(folded, choices))


def usage(choices: list[Choice]) -> Usage:
    """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice."""
    return Usage(sum(c.prompt_tokens for c in choices), sum(c.generated for c in choices),
                 sum(c.req.cached_tokens for c in choices if c.prompt_tokens))


async def collect(choices: list[Choice]) -> list[Folded]:
    """Every choice's deltas folded; a failed sequence fails the response."""
    folded = [Folded() for _ in choices]
    by_index = {c.index: i for i, c in enumerate(choices)}
    for c in choices:
        folded[by_index[c.index]].add(c.start())
    events = Merged(choices)
    try:
        while (item := await events.next()) is not None:
            choice, ev = item
            if isinstance(ev, FinishEvent):
                if ev.error is not None:
                    raise _unavailable(ev)
                delta = choice.on_finish(ev)
            else:
                delta = choice.on_token(ev)
            folded[by_index[choice.index]].add(delta)
    finally:
        events.close()
    return folded




def data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json_line(obj) + b"\n\n"


async def _sse(handle: ModelView, choices: list[Choice], view: StreamView) -> AsyncIterator[str | bytes]:
    events = Merged(choices)
    failed: FinishEvent | None = None
    try:
        for frame in view.opening(choices):
            yield frame
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    item = await events.next()
            except TimeoutError:
                yield view.keepalive()
                continue
            if item is None:
                break
            choice, ev = item
            if isinstance(ev, FinishEvent):
                delta: Delta = choice.on_finish(ev)
                failed = failed or (ev if ev.error is not None else None)
            else:
                delta = choice.on_token(ev)
            for frame in view.frames(delta, choices):
                yield frame
        for frame in view.closing(choices, _unavailable(failed) if failed is not None else None):
            yield frame
    finally:
        abort_all(handle, choices)
        events.close()
