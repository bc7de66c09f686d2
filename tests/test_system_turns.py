"""System turns inside an Anthropic conversation (``messages/system_turns.py``): rendered where
they stand by a template that takes them there, folded into the user turns by one that refuses
them (as Qwen3's and Llama 3's templates do), found by rendering each template once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from neuron.config import TemplateConfig
from neuron.loader.template_worker import TemplateRenderer
from neuron.server.messages.system_turns import place_system, takes_mid_system

TAKES = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
REFUSES = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
           "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
           "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def handle(template: str):
    """What place_system reads of a model: its tokenizer's template and special tokens."""
    info = SimpleNamespace(chat_template=template, bos_token=None, eos_token_ids=[], token=lambda i: "")
    return SimpleNamespace(spec=SimpleNamespace(tokenizer=info))


@pytest.fixture(scope="module")
def templates():
    renderer = TemplateRenderer(TemplateConfig())
    yield renderer
    renderer.close()


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "system", "content": "The date is Monday."}, {"role": "assistant", "content": "Hello."},
                {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Day?"},
                {"role": "assistant", "content": "Lundi."}, {"role": "system", "content": "Stop here."}]


def test_a_template_that_takes_them_renders_them_where_they_stand(templates):
    assert takes_mid_system(handle(TAKES), templates)
    origin = {"messages.4": "messages.3"}
    assert place_system(list(CONVERSATION), origin, handle(TAKES), templates) == CONVERSATION
    assert origin == {"messages.4": "messages.3"}


def test_a_template_that_refuses_them_gets_them_folded_into_user_turns(templates):
    assert not takes_mid_system(handle(REFUSES), templates)
    origin = {"messages.1": "messages.0", "messages.5": "messages.4", "messages.5.content.0": "messages.4.content.0",
              "messages.6": "messages.5"}
    out = place_system(list(CONVERSATION), origin, handle(REFUSES), templates)
    assert out == [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Hi\n\nThe date is Monday."},  # after the user turn: appended
                   {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": "Answer in French.\n\nDay?"},  # before the next one: prepended
                   {"role": "assistant", "content": "Lundi."},
                   {"role": "user", "content": "Stop here."}]  # none after: a user turn of its own
    assert origin == {"messages.1": "messages.0", "messages.3": "messages.4", "messages.3.content.0": "messages.4.content.0",
                      "messages.4": "messages.5"}
    text = templates.render(REFUSES, out)  # and the template now renders it
    assert "Answer in French." in text
