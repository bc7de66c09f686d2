"""A chat with tools renders its template once when the template shows the tools, and falls back to
our own tool prompt (three renders) only when it ignores them: a tool's name already in the
conversation does not pass for the template showing it. The default model's real spec, the real
template sandbox, templates sent with the request."""

from __future__ import annotations

import msgspec
import pytest

from conftest import DEFAULT_MODEL
from neuron.config import EngineConfig, ModelEntry, TemplateConfig
from neuron.loader.spec import load_spec
from neuron.loader.template_worker import TemplateRenderer
from neuron.server.core_client import CoreEngine, CoreModel
from neuron.server.openai.prompts import chat_prompt
from neuron.server.schemas import ChatRequest

SHOWS = ("{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
         "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
IGNORES = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
           "{% for c in m.tool_calls or [] %}[call {{ c.function.name }}]{% endfor %}\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
PLAIN = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
           {"role": "user", "content": "And in Rome?"}]


class Counting(TemplateRenderer):
    """The real renderer, counting its renders (the tools each was given)."""

    def __init__(self) -> None:
        super().__init__(TemplateConfig(), allow_client_templates=True)
        self.calls: list[list | None] = []

    def render(self, template, messages, **kwargs):
        self.calls.append(kwargs.get("tools"))
        return super().render(template, messages, **kwargs)


@pytest.fixture(scope="module")
def model() -> CoreModel:
    return CoreModel(DEFAULT_MODEL, ModelEntry(), load_spec(DEFAULT_MODEL), 2048,
                     CoreEngine(DEFAULT_MODEL, EngineConfig(), link=None))


@pytest.fixture(scope="module")
def templates():
    renderer = Counting()
    yield renderer
    renderer.close()


def prompt(model, templates, template: str, messages: list[dict]):
    templates.calls.clear()
    body = msgspec.convert({"model": DEFAULT_MODEL, "messages": messages, "tools": [TOOL],
                            "chat_template": template}, ChatRequest)
    return chat_prompt(body, model, templates)


@pytest.mark.parametrize("messages", [PLAIN, HISTORY], ids=["plain", "history"])
def test_a_template_that_shows_the_tools_gets_them(model, templates, messages):
    out = prompt(model, templates, SHOWS, messages)
    assert '<tools>[{"type": "function"' in out.prompt.text and "# Tools" not in out.prompt.text
    # one render where the name shows only there; with the name in the history too, a second
    # without tools proves the first showed them
    assert templates.calls == ([[TOOL]] if messages is PLAIN else [[TOOL], None])


@pytest.mark.parametrize("messages", [PLAIN, HISTORY], ids=["plain", "history"])
def test_a_template_that_ignores_them_gets_our_tool_prompt(model, templates, messages):
    out = prompt(model, templates, IGNORES, messages)
    assert templates.calls == [[TOOL], None, None]
    assert "# Tools" in out.prompt.text and '"name": "get_weather"' in out.prompt.text
    assert out.tools is not None and out.tools.syntax == "hermes"


def test_so_many_tools_that_counting_names_would_cost_more_take_the_second_render(model, templates):
    """Thousands of tools in a few MB of text: name counting would scan names x text (a hostile
    body's quadratic), so the template is rendered again without them instead."""
    many = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}
            for i in range(4000)]
    templates.calls.clear()
    body = msgspec.convert({"model": DEFAULT_MODEL, "messages": PLAIN, "tools": many, "chat_template": SHOWS},
                           ChatRequest)
    out = chat_prompt(body, model, templates)
    assert len(templates.calls) == 2 and templates.calls[1] is None
    assert '"name": "tool_3999"' in out.prompt.text and "# Tools" not in out.prompt.text
