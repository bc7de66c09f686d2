"""``context_management``: Anthropic's context edits, applied to the messages before they are
rendered, and what was cleared (``applied_edits``), as Anthropic reports it.

- ``clear_thinking_20251015``: thinking blocks of earlier assistant turns are dropped; ``keep`` is
  ``"all"`` or ``{"type": "thinking_turns", "value": N}`` (the last N assistant turns that think
  keep theirs; 1 when not given).
- ``clear_tool_uses_20250919``: once the input passes ``trigger`` (``{"type": "input_tokens",
  "value": N}``, 100,000 when not given), the oldest tool results are replaced by a note, all
  but the last ``keep`` (``{"type": "tool_uses", "value": N}``, 3) and those of ``exclude_tools``;
  with ``clear_tool_inputs`` their calls' inputs too. ``clear_at_least`` (``input_tokens``): when
  clearing would free fewer tokens than that, nothing is cleared.

Tokens are counted on the text the edits look at (thinking, tool results and inputs, and for
the trigger every text of the request) with the model's tokenizer."""

from __future__ import annotations

import copy
import json
from typing import Any, Callable

from neuron.server.messages.content import bad, only_keys

CLEARED = "[this tool result was cleared to save context]"
EDITS = ("clear_thinking_20251015", "clear_tool_uses_20250919")


def _count(value: dict[str, Any] | None, kind: str, default: int, param: str) -> int:
    if value is None:
        return default
    if not isinstance(value, dict) or value.get("type") != kind:
        raise bad(f"must be {{\"type\": \"{kind}\", \"value\": N}}", param)
    only_keys(value, {"type", "value"}, param)
    n = value.get("value")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise bad("value must be a whole number, 0 or more", f"{param}.value")
    return n


def _blocks(message: Any) -> list[dict[str, Any]]:
    """A message's blocks that are objects (the rest is refused by name later, when it is read)."""
    content = message.get("content") if isinstance(message, dict) else None
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _clear_thinking(messages: list[dict[str, Any]], edit: dict[str, Any], tokens: Callable[[str], int],
                    param: str) -> dict[str, Any] | None:
    only_keys(edit, {"type", "keep"}, param)
    keep = edit.get("keep")
    if keep == "all":
        return None
    keep_n = _count(keep, "thinking_turns", 1, f"{param}.keep")
    thinking_turns = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"
                      and any(b.get("type") in ("thinking", "redacted_thinking") for b in _blocks(m))]
    cleared = thinking_turns[:max(0, len(thinking_turns) - keep_n)]
    if not cleared:
        return None
    freed = 0
    for i in cleared:
        kept = []
        for block in _blocks(messages[i]):
            if block.get("type") in ("thinking", "redacted_thinking"):
                freed += tokens(str(block.get("thinking", block.get("data", ""))))
            else:
                kept.append(block)
        messages[i]["content"] = kept or [{"type": "text", "text": ""}]
    return {"type": "clear_thinking_20251015", "cleared_thinking_turns": len(cleared), "cleared_input_tokens": freed}


def _result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if isinstance(b, dict))


def _clear_tool_uses(messages: list[dict[str, Any]], edit: dict[str, Any], tokens: Callable[[str], int],
                     total: int, param: str) -> dict[str, Any] | None:
    only_keys(edit, {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"}, param)
    trigger = _count(edit.get("trigger"), "input_tokens", 100_000, f"{param}.trigger")
    keep = _count(edit.get("keep"), "tool_uses", 3, f"{param}.keep")
    at_least = _count(edit.get("clear_at_least"), "input_tokens", 0, f"{param}.clear_at_least")
    exclude = edit.get("exclude_tools") or []
    if not isinstance(exclude, list) or not all(isinstance(n, str) for n in exclude):
        raise bad("exclude_tools must be a list of tool names", f"{param}.exclude_tools")
    inputs = edit.get("clear_tool_inputs", False)
    if not isinstance(inputs, bool):
        raise bad("clear_tool_inputs must be true or false", f"{param}.clear_tool_inputs")
    if total <= trigger:
        return None
    calls = {}  # tool_use id -> its block
    for m in messages:
        for block in _blocks(m):
            if block.get("type") == "tool_use":
                calls[block.get("id")] = block
    results = [b for m in messages if isinstance(m, dict) and m.get("role") == "user" for b in _blocks(m)
               if b.get("type") == "tool_result" and calls.get(b.get("tool_use_id"), {}).get("name") not in exclude
               and _result_text(b) != CLEARED]
    chosen = results[:max(0, len(results) - keep)]
    freed = sum(tokens(_result_text(b)) + (tokens(json.dumps(calls.get(b.get("tool_use_id"), {}).get("input", {})))
                                            if inputs else 0) for b in chosen)
    if not chosen or freed < at_least:
        return None
    for block in chosen:
        block["content"] = CLEARED
        call = calls.get(block.get("tool_use_id"))
        if inputs and call is not None:
            call["input"] = {}
    return {"type": "clear_tool_uses_20250919", "cleared_tool_uses": len(chosen), "cleared_input_tokens": freed}


def apply_edits(raw: Any, messages: list[dict[str, Any]], tokens: Callable[[str], int],
                total: Callable[[list[dict[str, Any]]], int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages after ``raw``'s edits (a copy where any applies), and the applied edits (None
    when the request has no ``context_management``). ``tokens`` counts a text's tokens, ``total``
    the request's input with these messages."""
    if raw is None:
        return messages, None
    if not isinstance(raw, dict):
        raise bad("context_management must be an object with edits", "context_management")
    only_keys(raw, {"edits"}, "context_management")
    edits = raw.get("edits", [])
    if not isinstance(edits, list) or not all(isinstance(e, dict) for e in edits):
        raise bad("edits must be a list of edit objects", "context_management.edits")
    for i, edit in enumerate(edits):
        if edit.get("type") not in EDITS:
            raise bad(f"unknown context edit {str(edit.get('type'))[:60]!r} (supported: {', '.join(EDITS)})",
                      f"context_management.edits.{i}.type")
    applied = []
    out = copy.deepcopy(messages) if edits else messages
    for i, edit in enumerate(edits):
        param = f"context_management.edits.{i}"
        if edit["type"] == "clear_thinking_20251015":
            done = _clear_thinking(out, edit, tokens, param)
        else:
            done = _clear_tool_uses(out, edit, tokens, total(out), param)
        if done is not None:
            applied.append(done)
    return out, applied
