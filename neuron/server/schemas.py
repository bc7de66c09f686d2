"""OpenAI request bodies as msgspec Structs. Unknown fields are ignored, wrong types are a 400
that names the field."""

from __future__ import annotations

from typing import Any

import msgspec


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = None
    user: str | None = None
    # vLLM extensions: generate past EOS (benchmarks), and return the token ids alongside text
    ignore_eos: bool = False
    return_token_ids: bool = False


class ChatRequest(SamplingFields):
    messages: list[Message] = []
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str | int] | None = None
    logprobs: int | None = None
    echo: bool | None = None


class LoadRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    id: str | None = None
    tensor_parallel: int = 1
    device: str = "auto"
    devices: list[int] | None = None
    dtype: str = "auto"
    quant: str | None = None
    max_model_len: int | None = None
    max_slots: int | None = None


class UnloadRequest(msgspec.Struct):
    model: str


class FaultRequest(msgspec.Struct):
    model: str
    rank: int = 0
    kind: str = "oom"


class TokenizeRequest(msgspec.Struct):
    """vLLM's ``/tokenize``: ``prompt`` (a completion prompt) or ``messages`` (a conversation
    through the chat template), not both."""
    model: str | None = None  # default: the only model loaded
    prompt: str | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # default: true for prompt, false for messages (as vLLM)
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    code: str
    param: str | None = None


class ErrorEnvelope(msgspec.Struct):
    """Every error of every route."""
    error: ErrorDetail
