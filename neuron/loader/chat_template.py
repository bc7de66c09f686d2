"""Rendering a conversation with the model's own Jinja2 chat template, the way transformers
does (sandboxed, trim_blocks/lstrip_blocks, ``raise_exception``, ``tojson``, ``strftime_now``)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``) or failed to render."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"the model's chat template does not compile: {exc}") from None


def render_chat(template: str | None, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                add_generation_prompt: bool = True, bos_token: str | None = None, eos_token: str | None = None,
                extra: dict[str, Any] | None = None) -> str:
    context = dict(extra or {})
    context.update(messages=messages, add_generation_prompt=add_generation_prompt,
                   bos_token=bos_token or "", eos_token=eos_token or "")
    if tools:
        context["tools"] = tools
    try:
        return _compile(template or CHATML).render(**context)
    except TemplateError:
        raise
    except Exception as exc:  # a template bug must reach the client as a 400, not a 500
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
