"""The one pipeline every chat surface runs: OpenAI's chat completions, the Responses API and
Anthropic's Messages each only turn their body into a chat request (an adapter's ``to_chat``)
and the chat's deltas into their wire format (its view). Between them, the same steps in the
same order: the key, the body read within the body budget, the served model, the template lane
of a request that brings its own template, planning off the event loop, the choices made on it,
the response, the ignored fields named."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from neuron.errors import ApiError
from neuron.server.ignored import say_ignored
from neuron.server.openai.choices import Choice
from neuron.server.openai.generation import StreamView, respond
from neuron.server.openai.planning import plan_chat
from neuron.server.openai.prompts import ChatPrompt
from neuron.server.openai.requests import read_body
from neuron.server.schemas import ChatRequest
from neuron.server.state import AppState, origin_of, require_key
from protocol.engine_client import ModelView


def serving(state: AppState, model: str) -> ModelView:
    """The model a request names, if it is loaded and the server is not shutting down."""
    if state.draining:
        raise ApiError(503, "shutting_down", "the server is shutting down")
    handle = state.model(model)
    if handle.status != "loaded":
        raise ApiError(503, "model_unavailable", f"model {model!r} is {handle.status}", retry_after=5)
    return handle


Run = Callable[..., Awaitable[Any]]  # runs a blocking call off the event loop, within the body budget


@dataclass
class ChatTurn:
    """What an adapter makes of its body: the chat request, and how the pipeline treats it."""

    chat: ChatRequest
    view: Callable[[ChatPrompt, list[Choice]], StreamView]  # the surface's wire format, once planned
    ignored: list[str] = field(default_factory=list)  # the body's fields no surface knows (x-neuron-ignored)
    top: int | None = None  # top logprobs a token
    fit_context: bool = False  # Anthropic's rule: max_tokens cut to the context's room (plan_chat)
    rename: Callable[[ApiError], None] | None = None  # an error's param in the surface's own names
    after: Callable[[Response, list[Choice]], None] | None = None  # once the response exists (a store)


# (the request, its decoded body, the served model, the body's bytes, the off-loop runner)
Adapter = Callable[[Request, Any, ModelView, bytes, Run], Awaitable[ChatTurn]]


@asynccontextmanager
async def admitted(request: Request, kind: type, decode: Callable[[bytes, type], Any]) -> AsyncIterator[tuple]:
    """A generation request's first steps, within the body budget: the key checked, the body
    read and decoded as ``kind``, its model served. Yields (state, body bytes, body, model, the
    runner of work off the event loop)."""
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=False)
    data = await read_body(request, state.cfg.server.max_body_bytes)
    async with state.body_budget.hold(len(data)) as run:
        body = decode(data, kind)
        yield state, data, body, serving(state, body.model), run


async def serve_chat(request: Request, kind: type, decode: Callable[[bytes, type], Any], to_chat: Adapter) -> Response:
    """``kind``: the surface's body type, ``decode`` its decoder; ``to_chat`` its adapter."""
    async with admitted(request, kind, decode) as (state, data, body, handle, run):
        turn = await to_chat(request, body, handle, data, run)
        try:
            # Templating, tokenizing and compiling grammars take a while: off the event loop.
            async with state.templates.lane(turn.chat.chat_template is not None):
                plan, build = await run(plan_chat, turn.chat, handle, turn.top, state.compiler, state.templates,
                                        turn.fit_context)
        except ApiError as exc:
            if turn.rename is not None:
                turn.rename(exc)
            raise
    choices = build(origin_of(request))  # the sequences belong to the event loop
    response = await respond(request, state, handle, choices, turn.view(plan, choices), bool(turn.chat.stream),
                             turn.chat.user)
    if turn.after is not None:
        turn.after(response, choices)
    return say_ignored(request, response, turn.ignored, handle.id)
