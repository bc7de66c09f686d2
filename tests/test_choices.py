"""n choices and several prompts in one request, against the default model with the official
client: each choice is its own sequence with its own seed (seed + index, as vLLM derives them),
streamed choices interleave by index, and usage counts every choice (each prompt once)."""

from __future__ import annotations

import openai

from conftest import DEFAULT_MODEL

ASK = [{"role": "user", "content": "Tell me a story about a dog."}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=300)


def test_streamed_choices_interleave_and_each_is_the_sequence_of_its_own_seed(tp1):
    c = client(tp1)
    kw = dict(model=DEFAULT_MODEL, messages=ASK, temperature=1.0, seed=11, max_tokens=5)
    order, texts = [], {0: "", 1: "", 2: ""}
    usage = None
    for chunk in c.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw):
        for choice in chunk.choices:
            order.append(choice.index)
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert set(order) == {0, 1, 2}
    assert order != sorted(order)  # not one choice after the other
    whole = c.chat.completions.create(n=3, **kw)
    assert [ch.message.content for ch in whole.choices] == [texts[0], texts[1], texts[2]]
    for i in range(3):
        alone = c.chat.completions.create(**{**kw, "seed": 11 + i})
        assert alone.choices[0].message.content == texts[i]
    assert len(set(texts.values())) == 3
    assert usage.completion_tokens == whole.usage.completion_tokens == 15
    assert usage.prompt_tokens == whole.usage.prompt_tokens == alone.usage.prompt_tokens


def test_several_prompts_times_n_are_indexed_across_prompts(tp1):
    prompts = ["The capital of France is", "The capital of Italy is the city of"]
    out = client(tp1).completions.create(model=DEFAULT_MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    assert "Paris" in out.choices[0].text and out.choices[0].text == out.choices[1].text
    assert "Paris" not in out.choices[2].text and out.choices[2].text == out.choices[3].text
    one = [client(tp1).completions.create(model=DEFAULT_MODEL, prompt=p, max_tokens=4, temperature=0) for p in prompts]
    assert out.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in one)
    assert out.usage.completion_tokens == 16


def test_continuous_usage_counts_up_over_every_choice(tp1):
    seen = []
    for chunk in client(tp1).completions.create(model=DEFAULT_MODEL, prompt="Once upon a time", n=2, max_tokens=5,
                                                stream=True, stream_options={"include_usage": True,
                                                                             "continuous_usage_stats": True}):
        seen.append(chunk.usage.completion_tokens)
    assert seen == sorted(seen) and seen[-1] == 10


def test_logprobs_come_per_choice_in_the_openai_shapes(tp1):
    chat = client(tp1).chat.completions.create(model=DEFAULT_MODEL, messages=ASK, n=2, max_tokens=3, temperature=1.0,
                                               seed=2, logprobs=True, top_logprobs=2)
    for choice in chat.choices:
        entries = choice.logprobs.content
        assert len(entries) == 3
        assert all(len(e.top_logprobs) == 2 and e.bytes and e.logprob <= 0 for e in entries)
    text = client(tp1).completions.create(model=DEFAULT_MODEL, prompt="Once upon a time", n=2, max_tokens=3,
                                          logprobs=2, temperature=0)
    for choice in text.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
        assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
