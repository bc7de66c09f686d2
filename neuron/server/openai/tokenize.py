"""``/tokenize`` and ``/detokenize`` as vLLM has them, through the same template and tokenizer
code as the completion routes: a conversation's ``count`` is what its chat completion reports as
``prompt_tokens``."""

from __future__ import annotations

import asyncio
import functools

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from neuron.errors import ApiError
from protocol.engine_client import ModelView

from neuron.server.openai.prompts import chat_prompt, completion_prompts
from neuron.server.openai.requests import decode_json, read_body, read_json
from neuron.server.schemas import (ChatRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                      TokenizeResponse)
from neuron.server.state import AppState, require_key


def _json(body: msgspec.Struct) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


def _model(state: AppState, name: str | None) -> ModelView:
    if name is not None:
        return state.model(name)
    models = list(state.engine_client.models.values())
    if len(models) != 1:
        raise ApiError(400, "invalid_request", f"model is required when {len(models)} models are loaded",
                       param="model")
    return models[0]


def _check_prompt(prompt: str | None) -> None:
    if not prompt:
        raise ApiError(400, "invalid_request", "prompt must be a non-empty string", param="prompt")


async def tokenize(request: Request) -> Response:
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=False)
    data = await read_body(request, state.cfg.server.max_body_bytes)
    async with state.body_budget.hold(len(data)) as run:
        body = decode_json(data, TokenizeRequest)
        handle = _model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "invalid_request", "give either prompt or messages", param="prompt")
        if body.continue_final_message:
            raise ApiError(400, "invalid_request", "continue_final_message is not supported",
                           param="continue_final_message")
        # The completion routes' own prompt building: the count is the request's prompt_tokens.
        if body.messages is not None:
            chat = ChatRequest(model=handle.id, messages=body.messages, tools=body.tools,
                               chat_template_kwargs=body.chat_template_kwargs,
                               add_generation_prompt=body.add_generation_prompt,
                               add_special_tokens=bool(body.add_special_tokens))
            ids = (await run(functools.partial(chat_prompt, fit=False), chat, handle, state.templates)).prompt.ids
        else:
            _check_prompt(body.prompt)
            text = CompletionRequest(model=handle.id, prompt=body.prompt or "",
                                     add_special_tokens=body.add_special_tokens is not False)
            ids = (await run(functools.partial(completion_prompts, fit=False), text, handle))[0].ids
    tk = handle.spec.tokenizer.tokenizer
    strs = [tk.id_to_token(i) for i in ids] if body.return_token_strs else None
    return _json(TokenizeResponse(count=len(ids), max_model_len=handle.max_len, tokens=ids, token_strs=strs))


async def detokenize(request: Request) -> Response:
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=False)
    body = await read_json(request, DetokenizeRequest, state.cfg.server.max_body_bytes)
    handle = _model(state, body.model)
    vocab = handle.spec.config.vocab_size
    if not all(0 <= t < vocab for t in body.tokens):
        raise ApiError(400, "invalid_request", f"token ids must be in [0, {vocab})", param="tokens")
    tk = handle.spec.tokenizer.tokenizer
    text = await asyncio.to_thread(tk.decode, body.tokens, skip_special_tokens=False)
    return _json(DetokenizeResponse(prompt=text))
