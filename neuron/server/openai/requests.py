"""From an OpenAI request body to sequences: body limits, validation, sampling defaults, token
budgets, stops, and one ``OutputState`` with its ``EngineRequest`` per sequence (prompts x n). Every refusal is an ApiError
naming the field."""

from __future__ import annotations

import zlib
from array import array

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request

from neuron.errors import ApiError
from protocol import Sampling
from protocol.api_core import EngineRequest, Image
from protocol.engine_client import ModelView, TokenConstraint

from neuron.server.output.detokenizer import Detokenizer
from neuron.server.output.state import OutputState
from neuron.server.output.stops import StopMatcher
from neuron.server.schemas import SamplingFields
from neuron.server.state import Origin

T = TypeVar("T")

BUILTIN_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


async def read_json(request: Request, kind: type[T], limit: int) -> T:
    return decode_json(await read_body(request, limit), kind)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "request_too_large", f"request body over {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, "request_too_large", f"request body over {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or closed for sending too slowly: nobody reads the answer
        raise ApiError(400, "client_disconnected", "the client left before its body arrived") from None
    return b"".join(chunks)


def decode_json(data: bytes, kind: type[T]) -> T:
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


@dataclass
class Settings:
    """What every sequence of one request shares, checked once."""

    n: int
    max_tokens: int | None
    max_param: str
    stops: list[str]
    stop_token_ids: list[int]
    min_tokens: int
    logit_bias: list[tuple[int, float]]
    logprobs: int  # for the rank: 0 none, k: the chosen token and the k - 1 most likely
    shown: frozenset[int] | bool  # special tokens shown in the text
    sampling: Sampling = Sampling()  # resolved and checked once a request; each sequence's adds its own


def settings_of(body: SamplingFields, handle: ModelView, top: int | None, sequences: int,
                shown: set[int] | None = None) -> Settings:
    """``top``: top logprobs asked (None: no logprobs); ``sequences``: prompts x n."""
    vocab = handle.spec.config.vocab_size
    n = 1 if body.n is None else body.n
    _check(n >= 1, "n", "n must be at least 1")
    limit = handle.client.cfg.queue_size
    _check(n * sequences <= limit, "n", f"n x prompts is {n * sequences}; at most {limit} sequences per request")
    if body.max_completion_tokens is not None:
        max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = body.max_tokens, "max_tokens"
    if max_tokens is not None:
        _check(max_tokens >= 1, param, f"{param} must be at least 1")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    _check(len(stops) <= 16 and all(len(s) <= 1000 for s in stops), "stop", "at most 16 stop strings of 1000 characters")
    stop_ids = list(body.stop_token_ids or [])
    _check(len(stop_ids) <= 256 and all(0 <= t < vocab for t in stop_ids), "stop_token_ids",
           f"stop_token_ids must be at most 256 ids in [0, {vocab})")
    _check(body.min_tokens >= 0, "min_tokens", "min_tokens must not be negative")
    if max_tokens is not None:
        _check(body.min_tokens <= max_tokens, "min_tokens", f"min_tokens must not exceed {param}")
    bias = []
    for key, value in (body.logit_bias or {}).items():
        _check(key.strip().lstrip("-").isdigit() and 0 <= int(key) < vocab, "logit_bias",
               f"logit_bias keys must be token ids in [0, {vocab})")
        _check(math.isfinite(value), "logit_bias", "logit_bias values must be finite numbers")
        bias.append((int(key), max(-100.0, min(100.0, float(value)))))
    _check(len(bias) <= 1024, "logit_bias", "at most 1024 logit_bias entries")
    _check(body.truncate_prompt_tokens is None or body.truncate_prompt_tokens >= -1, "truncate_prompt_tokens",
           "truncate_prompt_tokens must be -1 or positive")
    visible: frozenset[int] | bool = True if not body.skip_special_tokens else frozenset(shown or ())
    settings = Settings(n, max_tokens, param, stops, stop_ids, body.min_tokens, bias, 0 if top is None else top + 1,
                        visible)
    settings.sampling = resolve_sampling(body, handle, settings)
    return settings


def truncate(body: SamplingFields, handle: ModelView, ids: list[int]) -> list[int]:
    """``truncate_prompt_tokens``: keep that many prompt tokens (-1: the context), the last ones
    unless ``truncation_side`` is "right"."""
    k = body.truncate_prompt_tokens
    if k is None:
        return ids
    if k == -1:
        k = handle.max_len - 1
    if len(ids) <= k:
        return ids
    return ids[:k] if body.truncation_side == "right" else ids[len(ids) - k:]


def resolve_sampling(body: SamplingFields, handle: ModelView, settings: Settings) -> Sampling:
    """The request's sampling, its defaults the model's (``generation_config.json``) or ours,
    every value checked; a sequence's own (its prompt's length, its seed, the end tokens) are
    ``sequence_sampling``'s."""
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
    _check(-(2**31) <= body.priority < 2**31, "priority", "priority must be in [-2^31, 2^31)")
    if top_k >= handle.spec.config.vocab_size:
        top_k = 0  # keeping every token is no filter at all
    return Sampling(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), min_p=min_p,
                    frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep,
                    logprobs=settings.logprobs, logit_bias=settings.logit_bias, min_tokens=settings.min_tokens,
                    stop_token_ids=sorted(set(settings.stop_token_ids)))


def sequence_sampling(settings: Settings, prompt_len: int, seed: int | None, eos: list[int]) -> Sampling:
    return msgspec.structs.replace(settings.sampling, prompt_len=prompt_len,
                                   seed=None if seed is None else seed % (2**63),
                                   stop_token_ids=sorted(set(eos) | set(settings.stop_token_ids)))


def check_sequence(body: SamplingFields, handle: ModelView, settings: Settings, prompt: list[int]) -> None:
    """A prompt that, with what it may generate, fits the model's context; the planners check
    each before ``make_request`` makes its sequences (on the event loop)."""
    limit = handle.max_len
    max_tokens = settings.max_tokens
    if len(prompt) >= limit or (max_tokens is not None and len(prompt) + max_tokens > limit):
        asked = len(prompt) + (max_tokens or 0)
        raise ApiError(400, "context_length_exceeded",
                       f"this model's maximum context length is {limit} tokens; the request needs {asked} "
                       f"({len(prompt)} in the prompt + {max_tokens or 0} to generate)",
                       param="prompt" if hasattr(body, "prompt") else "messages")


def make_request(body: SamplingFields, handle: ModelView, settings: Settings, prompt: list[int], choice: int,
                 origin: Origin, constraint: Callable[[int, int], TokenConstraint | None] | None = None,
                 images: Sequence[Image] = ()) -> OutputState:
    """One sequence: ``choice`` is its index among the n of its prompt (a seeded request derives
    seed + choice, as vLLM does); ``constraint`` makes its constraint from its token budget and a
    number of its own (the same for the same request, in any process). The planner checked
    ``prompt`` (``check_sequence``) and the sampling (``settings_of``)."""
    info = handle.spec.tokenizer
    eos = [] if body.ignore_eos else list(info.eos_token_ids)
    seed = None if body.seed is None else body.seed + choice
    budget = settings.max_tokens if settings.max_tokens is not None else handle.max_len - len(prompt)
    who = origin.who
    sampling = sequence_sampling(settings, len(prompt), seed, eos)
    wire = EngineRequest(origin.request_id, prompt, sampling, budget, sampling.stop_token_ids, who.name, who.weight,
                         who.max_running, who.max_waiting, body.priority,
                         (getattr(body, "cache_salt", None) or "").encode(), list(images))
    out = OutputState(wire, Detokenizer(info.tokenizer, settings.shown), StopMatcher(settings.stops),
                      constraint(budget, zlib.crc32(array("q", prompt).tobytes()) + choice)
                      if constraint is not None else None)
    if body.include_stop_str_in_output or settings.min_tokens:
        # No stop string before min_tokens tokens; the rank keeps the stop tokens out until then.
        armed = (lambda: len(out.output) >= settings.min_tokens) if settings.min_tokens else None
        out.stop_matcher = StopMatcher(settings.stops, include=body.include_stop_str_in_output, armed=armed)
    return out
