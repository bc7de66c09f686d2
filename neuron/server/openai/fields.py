"""Fields of vLLM's protocol that we accept but do not honour: any value other than the one that
asks for nothing is refused with a 400 naming the field, never silently ignored. Every other field
of ``schemas.py`` is honoured somewhere in ``neuron.server``."""

from __future__ import annotations

from typing import Any, Callable

from neuron.errors import ApiError

from neuron.server.schemas import CompletionRequest, SamplingFields


def _absent(value: Any) -> bool:
    return value is None or value == [] or value == {}


# field -> (does this value ask for nothing we lack?, why we refuse it otherwise)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "use_beam_search": (lambda v: not v, "beam search is not supported"),
    "length_penalty": (lambda v: v == 1.0, "length_penalty applies to beam search, which is not supported"),
    "prompt_logprobs": (_absent, "prompt logprobs are not supported"),
    "logprob_token_ids": (_absent, "logprobs of chosen token ids are not supported"),
    "structural_tag": (_absent, "structural tags are not supported"),
    "logits_processors": (_absent, "custom logits processors are not supported"),
    "return_token_offsets": (lambda v: not v, "token offsets are only for render endpoints, which do not exist here"),
    "kv_transfer_params": (_absent, "disaggregated serving (KV transfer) is not supported"),
    "ec_transfer_params": (_absent, "encoder-cache transfer is not supported"),
    "vllm_xargs": (_absent, "there are no custom extensions to take vllm_xargs"),
    "repetition_detection": (_absent, "repetition detection is not supported"),
    "max_repetition_pattern_size": (lambda v: v == 0, "repetition detection is not supported"),
    "min_repetition_pattern_size": (lambda v: v == 0, "repetition detection is not supported"),
    "repetition_min_count": (lambda v: v == 0, "repetition detection is not supported"),
    "mm_processor_kwargs": (_absent, "multimodal input is not supported"),
    "media_io_kwargs": (_absent, "multimodal input is not supported"),
}
REFUSED_IN_COMPLETIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (lambda v: not v, "suffix (fill-in-the-middle) is not supported"),
    "prompt_embeds": (_absent, "prompt embeddings are not supported"),
    "thinking_token_budget": (lambda v: v is None or v == -1, "a text completion has no chat template to think in"),
}
GRAMMAR_BACKENDS = (None, "auto", "guidance", "llguidance")


def refuse_unsupported(body: SamplingFields) -> None:
    table = {**REFUSED, **(REFUSED_IN_COMPLETIONS if isinstance(body, CompletionRequest) else {})}
    for name, (fine, why) in table.items():
        if not fine(getattr(body, name)):
            raise ApiError(400, "invalid_request", f"{name}: {why}", param=name)
    n = body.n if body.n is not None else 1
    if body.best_of is not None and body.best_of != n:
        raise ApiError(400, "invalid_request", "best_of other than n is not supported", param="best_of")
    if body.guided_decoding_backend not in GRAMMAR_BACKENDS:
        raise ApiError(400, "invalid_request", "guided_decoding_backend: the only grammar backend is llguidance "
                       "('guidance')", param="guided_decoding_backend")
    if body.truncation_side not in (None, "left", "right"):
        raise ApiError(400, "invalid_request", "truncation_side must be 'left' or 'right'", param="truncation_side")
