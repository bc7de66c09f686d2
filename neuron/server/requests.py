"""From an OpenAI request body to a GenRequest: body limits, validation, sampling defaults,
the chat template and tokenizing. Every refusal is an ApiError naming the field."""

from __future__ import annotations

import math
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

from neuron.engine.detokenizer import Detokenizer
from neuron.engine.request import GenRequest
from neuron.errors import ApiError
from neuron.loader.chat_template import TemplateError, render_chat
from neuron.registry import ModelHandle
from protocol import Sampling

from .schemas import ChatRequest, CompletionRequest, Message, SamplingFields

T = TypeVar("T")

BUILTIN_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


async def read_json(request: Request, kind: type[T], limit: int) -> T:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "request_too_large", f"request body over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "request_too_large", f"request body over {limit} bytes")
        chunks.append(chunk)
    data = b"".join(chunks)
    try:
        # JSON text is UTF-8 (RFC 8259). msgspec skips unknown keys without checking their bytes,
        # so a broken byte inside a key ("max_to\xc3kens") would silently drop that field.
        data.decode("utf-8")
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = message.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in message else None
        raise ApiError(400, "invalid_request", f"invalid request: {message}", param=param) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_request", f"malformed JSON body: {str(exc)[:200]}") from None
    except RecursionError:
        raise ApiError(400, "invalid_request", "JSON body is nested too deeply") from None


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ApiError(400, "invalid_request", message, param=param)


def resolve_sampling(body: SamplingFields, handle: ModelHandle, prompt_len: int, logprobs: int) -> Sampling:
    def pick(name: str) -> Any:
        value = getattr(body, name)
        if value is None:
            value = handle.spec.sampling_defaults.get(name, BUILTIN_SAMPLING.get(name))
        return value

    temperature, top_p, top_k = float(pick("temperature")), float(pick("top_p")), int(pick("top_k"))
    min_p, rep = float(pick("min_p")), float(pick("repetition_penalty"))
    freq, pres = float(body.frequency_penalty or 0.0), float(body.presence_penalty or 0.0)
    for name, value in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
                        ("repetition_penalty", rep), ("frequency_penalty", freq), ("presence_penalty", pres)):
        _check(math.isfinite(value), name, f"{name} must be a finite number")
    _check(0.0 <= temperature <= 100.0, "temperature", "temperature must be between 0 and 100")
    _check(0.0 < top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
    _check(top_k >= -1, "top_k", "top_k must be -1, 0 (disabled) or positive")
    _check(0.0 <= min_p <= 1.0, "min_p", "min_p must be in [0, 1]")
    _check(rep > 0.0, "repetition_penalty", "repetition_penalty must be positive")
    _check(-2.0 <= freq <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]")
    _check(-2.0 <= pres <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]")
    if body.seed is not None:
        _check(-(2**63) <= body.seed < 2**64, "seed", "seed is out of range")
    if top_k >= handle.spec.config.vocab_size:
        top_k = 0  # keeping every token is no filter at all
    return Sampling(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), min_p=min_p,
                    seed=None if body.seed is None else body.seed % (2**63),
                    frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep,
                    prompt_len=prompt_len, logprobs=logprobs)


def chat_prompt(body: ChatRequest, handle: ModelHandle) -> list[int]:
    return encode_chat(body.messages, handle, tools=body.tools, template_kwargs=body.chat_template_kwargs)


def encode_chat(messages_in: list[Message], handle: ModelHandle, *, tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
                add_special_tokens: bool = False) -> list[int]:
    """The conversation through the model's chat template, as the model will see it (also
    ``/tokenize``'s, so its count is the request's prompt_tokens)."""
    _check(bool(messages_in), "messages", "messages must not be empty")
    messages = []
    for i, m in enumerate(messages_in):
        _check(m.role in ("system", "user", "assistant", "tool", "developer"), f"messages.{i}.role",
               f"unknown role {m.role[:40]!r}")
        content = m.content
        if isinstance(content, list):
            for part in content:
                _check(part.type == "text", f"messages.{i}.content", f"content part type {part.type[:40]!r} is not supported")
            content = "".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        messages.append(message)
    info = handle.spec.tokenizer
    try:
        text = render_chat(info.chat_template, messages, tools=tools, bos_token=info.bos_token,
                           eos_token=info.token(info.eos_token_ids[0]) if info.eos_token_ids else None,
                           extra=template_kwargs, add_generation_prompt=add_generation_prompt)
    except TemplateError as exc:
        raise ApiError(400, "invalid_request", str(exc), param="messages") from None
    return _with_bos(info, info.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)


def completion_prompt(body: CompletionRequest, handle: ModelHandle) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        vocab = handle.spec.config.vocab_size
        _check(all(0 <= t < vocab for t in prompt), "prompt", f"token ids must be in [0, {vocab})")
        return list(prompt)  # type: ignore[arg-type]
    if isinstance(prompt, list):
        _check(len(prompt) == 1 and isinstance(prompt[0], str), "prompt",
               "prompt must be a string, one string in a list, or a list of token ids")
        prompt = prompt[0]
    _check(isinstance(prompt, str) and prompt != "", "prompt", "prompt must be a non-empty string")
    return encode_text(prompt, handle)  # type: ignore[arg-type]


def encode_text(prompt: str, handle: ModelHandle, *, add_special_tokens: bool = True) -> list[int]:
    info = handle.spec.tokenizer
    ids = info.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids
    return _with_bos(info, ids) if add_special_tokens else ids


def _with_bos(info, ids: list[int]) -> list[int]:
    if info.add_bos and info.bos_token:
        bos = info.tokenizer.token_to_id(info.bos_token)
        if bos is not None and (not ids or ids[0] != bos):
            return [bos, *ids]
    return ids


def make_request(body: SamplingFields, handle: ModelHandle, prompt: list[int], logprobs: int) -> GenRequest:
    _check(body.n in (None, 1), "n", "n > 1 is not supported yet")
    limit = handle.max_len
    if body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
        param = "max_completion_tokens"
    else:
        max_tokens, param = body.max_tokens, "max_tokens"
    if max_tokens is not None:
        _check(max_tokens >= 1, param, f"{param} must be at least 1")
    if len(prompt) >= limit or (max_tokens is not None and len(prompt) + max_tokens > limit):
        asked = len(prompt) + (max_tokens or 0)
        raise ApiError(400, "context_length_exceeded",
                       f"this model's maximum context length is {limit} tokens; the request needs {asked} "
                       f"({len(prompt)} in the prompt + {max_tokens or 0} to generate)", param="messages")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    _check(len(stops) <= 16 and all(len(s) <= 1000 for s in stops), "stop", "at most 16 stop strings of 1000 characters")
    sampling = resolve_sampling(body, handle, len(prompt), logprobs)
    info = handle.spec.tokenizer
    return GenRequest(
        prompt=prompt,
        sampling=sampling,
        max_tokens=max_tokens if max_tokens is not None else limit - len(prompt),
        stop=stops,
        stop_token_ids=frozenset() if body.ignore_eos else frozenset(info.eos_token_ids),
        detokenizer=Detokenizer(info.tokenizer),
    )
