"""``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``: validate, plan the choices
(prompts x n, each with its constraint and text pipeline), then run them (``generation``)."""

from __future__ import annotations


from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuron.errors import ApiError
from neuron.model_names import is_glob
from protocol.engine_client import ModelView

from neuron.server.openai.fields import refuse_unsupported
from neuron.server.chat_pipeline import ChatTurn, admitted, serve_chat
from neuron.server.openai.generation import Chunks, respond
from neuron.server.openai.planning import plan_completion
from neuron.server.ignored import unknown_fields, say_ignored
from neuron.server.openai.requests import decode_json
from neuron.server.schemas import ChatRequest, CompletionRequest, SamplingFields
from neuron.server.state import AppState, origin_of, require_key
from neuron.server.openai.views import ChatView, CompletionView



def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


async def _chat_turn(request: Request, body: ChatRequest, handle: ModelView, data: bytes, run) -> ChatTurn:
    """Chat completions' adapter: the body is the chat request."""
    refuse_unsupported(body)
    if body.top_logprobs and not body.logprobs:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else None
    _check_common(body, top, "top_logprobs")
    view = ChatView(model=body.model, tokenizer=handle.spec.tokenizer.tokenizer, top_logprobs=top,
                    return_token_ids=bool(body.return_token_ids), tokens_as_ids=bool(body.return_tokens_as_token_ids),
                    request_id=body.request_id)
    return ChatTurn(body, lambda plan, choices: Chunks(view, *_usage_options(body)), unknown_fields(data, ChatRequest),
                    top)


async def chat_completions(request: Request) -> Response:
    return await serve_chat(request, ChatRequest, decode_json, _chat_turn)


async def completions(request: Request) -> Response:
    async with admitted(request, CompletionRequest, decode_json) as (state, data, body, handle, run):
        ignored = unknown_fields(data, CompletionRequest)
        refuse_unsupported(body)
        top = body.logprobs
        _check_common(body, top, "logprobs")
        if body.echo and top is not None:
            raise _bad("echo with logprobs needs prompt logprobs, which are not supported", "echo")
        build = await run(plan_completion, body, handle, top, state.compiler)
    choices = build(origin_of(request))
    view = CompletionView(model=body.model, tokenizer=handle.spec.tokenizer.tokenizer, top_logprobs=top,
                          return_token_ids=bool(body.return_token_ids),
                          tokens_as_ids=bool(body.return_tokens_as_token_ids), request_id=body.request_id)
    response = await respond(request, state, handle, choices, Chunks(view, *_usage_options(body)),
                             bool(body.stream), body.user)
    return say_ignored(request, response, ignored, handle.id)


async def list_models(request: Request) -> Response:
    state: AppState = request.app.state.neuron
    require_key(request, state, admin=False)
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "neuron", "max_model_len": h.max_len,
             "status": h.status, **({"root": h.id} if name != h.id else {})}
            for h in state.engine_client.models.values()
            for name in [h.id, *(a for a in h.entry.aliases if not is_glob(a))]]
    return JSONResponse({"object": "list", "data": data})


def _check_common(body: SamplingFields, top: int | None, param: str) -> None:
    if top is not None and not 0 <= top <= 20:
        raise _bad(f"{param} must be in [0, 20]", param)
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options needs stream: true", "stream_options")


def _usage_options(body: SamplingFields) -> tuple[bool, bool]:
    options = body.stream_options
    return bool(options and options.include_usage), bool(options and options.continuous_usage_stats)
