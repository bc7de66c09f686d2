"""A request's sampling is resolved and checked once, however many sequences it makes (prompts x
n): each sequence's differs only in what is its own (its prompt's length, its seed, the end
tokens). The default model's real spec (tokenizer, config) plans the requests."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from conftest import DEFAULT_MODEL
from neuron.config import EngineConfig, GrammarConfig, ModelEntry
from neuron.server.grammar.worker import GrammarCompiler
from neuron.errors import ApiError
from neuron.loader.spec import load_spec
from neuron.server.core_client import CoreEngine, CoreModel
from neuron.server.openai import planning, requests
from neuron.server.keys import Principal
from neuron.server.schemas import CompletionRequest
from neuron.server.state import Origin


@pytest.fixture(scope="module")
def model() -> CoreModel:
    """The default model as an API process holds it (its engine's requests would go to the core)."""
    return CoreModel(DEFAULT_MODEL, ModelEntry(), load_spec(DEFAULT_MODEL), 2048,
                     CoreEngine(DEFAULT_MODEL, EngineConfig(), link=None))


def completion(**fields) -> CompletionRequest:
    return msgspec.convert({"model": DEFAULT_MODEL, "max_tokens": 4, **fields}, CompletionRequest)


def test_two_prompts_of_three_choices_resolve_their_sampling_once(model, monkeypatch):
    calls = []
    resolve = requests.resolve_sampling
    monkeypatch.setattr(requests, "resolve_sampling", lambda *a: calls.append(a) or resolve(*a))
    compiler = GrammarCompiler(GrammarConfig())
    try:
        body = completion(prompt=["Hello there", "The capital of France is"], n=3, seed=7, temperature=0.5,
                          stop_token_ids=[5])
        build = planning.plan_completion(body, model, None, compiler)

        async def made() -> list:  # a request is made on the event loop (its futures are that loop's)
            return build(Origin("req-7", Principal("team", max_running=2, weight=3.0)))
        choices = asyncio.run(made())
    finally:
        compiler.close()
    assert len(calls) == 1 and len(choices) == 6
    samplings = [c.req.wire.sampling for c in choices]
    lengths = [len(c.req.prompt) for c in choices]
    assert [s.prompt_len for s in samplings] == lengths and lengths[0] != lengths[3]
    assert [s.seed for s in samplings] == [7, 8, 9, 7, 8, 9]  # seed + choice, as vLLM does
    eos = set(model.spec.tokenizer.eos_token_ids)
    assert all(set(s.stop_token_ids) == eos | {5} and s.temperature == 0.5 for s in samplings)
    # Whose request it is goes in with each sequence's request, not patched on after.
    assert {(c.req.wire.request_id, c.req.wire.principal, c.req.wire.weight, c.req.wire.max_running,
             tuple(c.req.wire.stop_token_ids)) for c in choices} == {("req-7", "team", 3.0, 2, tuple(sorted(eos | {5})))}


@pytest.mark.parametrize("fields,param", [({"temperature": 101}, "temperature"), ({"top_p": 0}, "top_p"),
                                          ({"seed": 2**64}, "seed"), ({"presence_penalty": 3}, "presence_penalty")])
def test_a_bad_sampling_value_is_refused_when_the_request_is_planned(model, fields, param):
    compiler = GrammarCompiler(GrammarConfig())
    try:
        with pytest.raises(ApiError) as refused:
            planning.plan_completion(completion(prompt="Hi", **fields), model, None, compiler)
    finally:
        compiler.close()
    assert refused.value.status == 400 and refused.value.param == param
