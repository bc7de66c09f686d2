"""A prompt whose bytes alone say it cannot fit the context is refused before it is tokenized
(``server/openai/prompts.encode_prompt``): the bound's premise (a token stands for at most as
many bytes as its own string holds) checked on the default model's real tokenizer over texts of
every script, and what is refused and what is not."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron.errors import ApiError
from neuron.loader.resolve import default_model_path
from neuron.loader.spec import load_spec
from neuron.loader.tokenizer import encode_ids
from neuron.server.openai.prompts import PROMPT_SLACK, encode_prompt, longest_token_bytes


@pytest.fixture(scope="module")
def info():
    return load_spec(str(default_model_path())).tokenizer


TEXTS = st.one_of(st.text(max_size=400), st.text(alphabet=" \n\t", max_size=400),
                  st.text(alphabet="日本語の文章😀🙂\u0301é", max_size=200),
                  st.from_regex(r"[a-z ]{0,300}", fullmatch=True))


@settings(max_examples=300, deadline=None)
@given(text=TEXTS)
def test_no_token_of_the_default_vocabulary_stands_for_more_bytes_than_its_string_holds(info, text):
    longest = longest_token_bytes(info.tokenizer)
    for special in (False, True):
        ids = encode_ids(info.tokenizer, text, special)
        assert len(ids) * longest >= len(text.encode("utf-8", "surrogatepass"))


def test_a_prompt_that_cannot_fit_is_refused_unread_and_one_that_may_is_tokenized(info):
    longest = longest_token_bytes(info.tokenizer)
    assert 8 <= longest <= 256  # SmolLM2's byte-level vocabulary: runs of spaces and words
    bound = PROMPT_SLACK * longest * 2048
    with pytest.raises(ApiError) as refused:
        encode_prompt(info, "The quick brown fox. " * (bound // 21 + 1), False, 2048, "messages")
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert refused.value.param == "messages" and "bytes" in refused.value.message
    # Just under the bound: tokenized, and far longer than the context (check_sequence refuses it
    # by its token count, as before).
    ids = encode_prompt(info, "The quick brown fox. " * (bound // 21 - 1), False, 2048, "prompt")
    assert len(ids) > 2048
    assert encode_prompt(info, "Hello", False, 2048, "prompt") == encode_ids(info.tokenizer, "Hello", False)
