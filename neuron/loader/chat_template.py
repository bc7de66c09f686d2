"""Rendering a conversation with the model's own Jinja2 chat template, the way transformers
does (sandboxed, trim_blocks/lstrip_blocks, ``raise_exception``, ``tojson``, ``strftime_now``,
the ``{% generation %}`` block, ``tools``/``documents`` always defined, reasoning aliases).

A template is a program: the daemon renders through ``neuron.loader.template_worker``, which
runs this in a process it can kill. Here, strings and lists made by ``*`` and ``+`` and the
output are bounded by ``max_chars``, so the common ways to ask for gigabytes fail at once."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``) or failed to render."""


class TemplateTooLarge(TemplateError):
    """The template made a string, list or output longer than its bound."""


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+"})
    max_chars = 0

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        sized = (str, list, tuple)
        if operator == "*" and isinstance(right, sized) and isinstance(left, int):
            left, right = right, left
            size = len(left) * right
        elif operator == "*" and isinstance(left, sized) and isinstance(right, int):
            size = len(left) * right
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            size = len(left) + len(right)
        else:
            size = 0
        if size > self.max_chars:
            raise TemplateTooLarge(f"the chat template made a value of {size} items (at most {self.max_chars})")
        return super().call_binop(context, operator, left, right)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    transformers; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


# Names a message's reasoning goes by; templates read ``reasoning_content`` (gpt-oss: ``thinking``).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compile(source: str, max_chars: int) -> jinja2.Template:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols])
    env.max_chars = max_chars
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"the chat template does not compile: {exc}") from None


def render_chat(template: str | None, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                documents: list[dict] | None = None, add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None,
                extra: dict[str, Any] | None = None, max_chars: int = 1 << 26) -> str:
    context = {"bos_token": bos_token or "", "eos_token": eos_token or "", **(extra or {})}
    # As transformers: ``tools`` and ``documents`` are always defined (None when not given).
    context.update(messages=_alias_reasoning(messages), tools=tools, documents=documents,
                   add_generation_prompt=add_generation_prompt)
    try:
        text = _compile(template or CHATML, max_chars).render(**context)
    except TemplateError:
        raise
    except MemoryError:
        raise TemplateTooLarge("the chat template ran out of its memory") from None
    except Exception as exc:  # a template bug must reach the client as a 400, not a 500
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    if len(text) > max_chars:
        raise TemplateTooLarge(f"the chat template's output of {len(text)} characters is over {max_chars}")
    return text
