"""OpenAI request bodies as msgspec Structs, with every field of vLLM's chat and completions
protocols. Unknown fields change nothing and are named in ``x-neuron-ignored`` (``ignored.py``);
a field vLLM has and we do not honour is refused by ``openai/fields.py`` with a 400 that names
it; wrong types are a 400 that names the field."""

from __future__ import annotations

from typing import Any

import msgspec


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None  # {"url": "data:image/png;base64,..."} (or the URL alone)


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(msgspec.Struct):
    """What chat and text completions share."""

    model: str
    stream: bool | None = False
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
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: Any = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None
    logits_processors: Any = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = False
    return_token_offsets: bool | None = False
    cache_salt: str | None = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    max_repetition_pattern_size: int = 0
    min_repetition_pattern_size: int = 0
    repetition_min_count: int = 0
    thinking_token_budget: int | None = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None


class ChatRequest(SamplingFields):
    messages: list[Message] = []
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[Any] | None = None  # a string, strings, token ids, or lists of token ids
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None


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
    aliases: list[str] | None = None  # more names it answers to (model_names.py)


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
