"""``system`` turns inside ``messages`` (Claude Code sends the environment as one, after the first
user turn): rendered where they stand when the model's chat template takes a system message
there, otherwise folded into the user turn before them (appended), or else the one after them
(prepended), or else made a user turn of their own. Whether a template takes them is found once
per template, by rendering a user, a system and a user message with it."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from neuron.loader.chat_template import TemplateError
from neuron.loader.template_worker import TemplateRenderer
from protocol.engine_client import ModelView

_PROBE = ("\u2063probe-user-1\u2063", "\u2063probe-system\u2063", "\u2063probe-user-2\u2063")
_TAKES: dict[str, bool] = {}  # template digest -> takes a system message mid-conversation


def takes_mid_system(handle: ModelView, templates: TemplateRenderer) -> bool:
    info = handle.spec.tokenizer
    template = info.chat_template or ""
    key = hashlib.sha256(template.encode()).hexdigest()
    if key not in _TAKES:
        probe = [{"role": role, "content": text} for role, text in zip(("user", "system", "user"), _PROBE)]
        try:
            text = templates.render(info.chat_template, probe, bos_token=info.bos_token,
                                    eos_token=info.token(info.eos_token_ids[0]) if info.eos_token_ids else None)
            _TAKES[key] = 0 <= text.find(_PROBE[0]) < text.find(_PROBE[1]) < text.find(_PROBE[2])
        except TemplateError:
            _TAKES[key] = False
    return _TAKES[key]


def _join(content: Any, text: str, before: bool) -> Any:
    if isinstance(content, str):
        return f"{text}\n\n{content}" if before else f"{content}\n\n{text}"
    part = {"type": "text", "text": text}
    return [part, *content] if before else [*content, part]


def _renumber(origin: dict[str, str], mapping: dict[int, int]) -> dict[str, str]:
    out = {}
    for key, value in origin.items():
        m = re.match(r"messages\.(\d+)(.*)", key)
        if m is None:
            out[key] = value
        elif int(m.group(1)) in mapping:
            out[f"messages.{mapping[int(m.group(1))]}{m.group(2)}"] = value
    return out


def place_system(messages: list[dict[str, Any]], origin: dict[str, str], handle: ModelView,
                 templates: TemplateRenderer) -> list[dict[str, Any]]:
    """``messages`` (chat messages, the top-level system first) with their later system turns
    where the template takes them; ``origin`` is renumbered to match."""
    late = [i for i, m in enumerate(messages) if m["role"] == "system" and i > 0]
    if not late or takes_mid_system(handle, templates):
        return messages
    out: list[dict[str, Any]] = []
    mapping: dict[int, int] = {}
    pending: list[str] = []  # system texts waiting for the next user turn
    for i, m in enumerate(messages):
        if m["role"] == "system" and i > 0:
            if out and out[-1]["role"] == "user":
                out[-1] = {**out[-1], "content": _join(out[-1]["content"], m["content"], before=False)}
            else:
                pending.append(m["content"])
            mapping[i] = len(out) - 1 if out and out[-1]["role"] == "user" else len(out)
            continue
        if pending and m["role"] == "user":
            m = {**m, "content": _join(m["content"], "\n\n".join(pending), before=True)}
            pending = []
        elif pending:  # no user turn next: a user turn of their own
            out.append({"role": "user", "content": "\n\n".join(pending)})
            pending = []
        mapping[i] = len(out)
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    renumbered = _renumber(origin, mapping)
    origin.clear()
    origin.update(renumbered)
    return out
