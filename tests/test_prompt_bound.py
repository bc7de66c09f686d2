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
from neuron.loader.tokenizer import byte_alphabet, encode_ids
from neuron.server.openai.prompts import PROMPT_SLACK, encode_prompt, longest_token_bytes


@pytest.fixture(scope="module")
def info():
    return load_spec(str(default_model_path())).tokenizer


TEXTS = st.one_of(st.text(max_size=400), st.text(alphabet=" \n\t", max_size=400),
                  st.text(alphabet="日本語の文章😀🙂\u0301é", max_size=200),
                  st.from_regex(r"[a-z ]{0,300}", fullmatch=True))


def spelled(info, text: str) -> int:
    """The bytes of ``text`` the vocabulary can spell: SmolLM2's byte-level vocabulary has no
    token for the control bytes 4, 6, 19, 20, 22 and 29 (nor for bytes UTF-8 never holds), which
    its tokenizer drops, as transformers' does."""
    if not hasattr(info, "spellable"):
        vocab, alphabet = info.tokenizer.get_vocab(), byte_alphabet()
        info.spellable = bytes(alphabet[b] in vocab for b in range(256))
    return sum(info.spellable[b] for b in text.encode("utf-8", "surrogatepass"))


def test_the_bytes_the_default_vocabulary_cannot_spell_are_dropped():
    info = load_spec(str(default_model_path())).tokenizer
    assert encode_ids(info.tokenizer, "\x16", False) == [] and spelled(info, "\x16") == 0
    assert encode_ids(info.tokenizer, "a\x16b", False) == encode_ids(info.tokenizer, "a", False) + \
        encode_ids(info.tokenizer, "b", False)


@settings(max_examples=300, deadline=None)
@given(text=TEXTS)
def test_no_token_of_the_default_vocabulary_stands_for_more_bytes_than_its_string_holds(info, text):
    longest = longest_token_bytes(info.tokenizer)
    for special in (False, True):
        ids = encode_ids(info.tokenizer, text, special)
        assert len(ids) * longest >= spelled(info, text)


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
