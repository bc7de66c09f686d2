"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over the
chat machinery. The body becomes a chat request (``request``), is planned as a chat is, runs on
the engine, and its deltas become Anthropic's events or message (``view``). ``x-api-key`` is
taken as well as a bearer key; ``anthropic-version``, ``anthropic-beta`` and ``?beta=true`` are
accepted as Anthropic's clients send them."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuron.errors import ApiError
from neuron.server.ignored import say_ignored

from neuron.server.messages.errors import in_anthropic_envelope
from neuron.server.messages.request import CountTokensRequest, MessagesRequest, Translation, our_name, translate
from neuron.server.messages.view import MessageView
from neuron.server.chat_pipeline import ChatTurn, admitted, serve_chat
from neuron.server.openai.prompts import chat_prompt
from neuron.server.openai.requests import decode_json
from protocol.engine_client import ModelView
from neuron.server.state import AppState

_TRANSLATION = "neuron.messages.translation"


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


def _rename(request: Request, exc: ApiError) -> None:
    translation: Translation | None = request.scope.get(_TRANSLATION)
    if translation is not None and exc.param is not None:
        exc.param = our_name(exc.param, translation.origin)


def _decode(data: bytes, kind: type):
    try:
        return decode_json(data, kind)
    except ApiError as exc:
        if "unknown field `" in exc.message:  # msgspec: "Object contains unknown field `x`"
            exc.param = exc.message.split("unknown field `", 1)[1].split("`", 1)[0]
            exc.message = f"{exc.param}: Extra inputs are not permitted"
        raise


@asynccontextmanager
async def _translated(request: Request, kind: type) -> AsyncIterator[tuple]:
    """Within the body budget: the state, the body, its model, its chat translation, and the
    runner of work off the event loop."""
    async with admitted(request, kind, _decode) as (state, _, body, handle, run):
        yield state, body, handle, await _translation(request, body, handle, run), run


async def _translation(request: Request, body: CountTokensRequest, handle: ModelView, run) -> Translation:
    """The body as a chat, off the event loop; kept in the request's scope so that the envelope
    names a failing field as the body did."""
    state: AppState = request.app.state.neuron
    translation = await run(translate, body, handle, state.templates)
    request.scope[_TRANSLATION] = translation
    return translation


async def _message_turn(request: Request, body: MessagesRequest, handle: ModelView, data: bytes, run) -> ChatTurn:
    """The Messages API's adapter: the body translated into a chat (tools, thinking, system turns,
    context edits), Anthropic's rule for max_tokens past the context, Anthropic's events."""
    translation = await _translation(request, body, handle, run)
    return ChatTurn(translation.chat, lambda plan, choices: MessageView(body.model, translation.show_thinking,
                                                                        plan.fitted, translation.applied_edits),
                    translation.ignored, fit_context=True)


async def _create_message(request: Request) -> Response:
    return await serve_chat(request, MessagesRequest, _decode, _message_turn)


async def _count_tokens(request: Request) -> Response:
    async with _translated(request, CountTokensRequest) as (state, _, handle, translation, run):
        plan = await run(chat_prompt, translation.chat, handle, state.templates)
    response = JSONResponse({"input_tokens": len(plan.prompt.ids)})
    return say_ignored(request, response, translation.ignored, handle.id)


create_message = in_anthropic_envelope(_create_message, _rename)
count_tokens = in_anthropic_envelope(_count_tokens, _rename)
