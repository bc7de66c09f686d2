"""Anthropic content as chat messages: system blocks to the system message (and ``system``
messages inside ``messages`` to system messages where they stand: ``request.place_system``), text and base64
image blocks to chat content, ``tool_use`` blocks to tool calls, ``tool_result`` blocks to tool
messages (their images in a user turn after them), thinking to ``reasoning_content``; consecutive
messages of one role are one turn, as Anthropic combines them. Each chat message and part keeps
the Anthropic path it came from, so that an error the chat path raises names the right field."""

from __future__ import annotations

import json
from typing import Any

from neuron.errors import ApiError

# Claude Code's first system block: a per-request billing hash for Anthropic's API, not an
# instruction, and it would make every prompt's prefix differ (no prefix cache hit).
BILLING_HEADER = "x-anthropic-billing-header"
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
SERVED_BLOCKS = ("text", "image", "thinking", "redacted_thinking", "tool_use", "tool_result")


def bad(message: str, param: str) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


def unset(value: Any) -> bool:
    return value is None or value == [] or value == {}


def only_keys(obj: dict[str, Any], keys: set[str], param: str) -> None:
    unknown = sorted(set(obj) - keys)
    if unknown:
        raise bad(f"unknown field {unknown[0]!r}", f"{param}.{unknown[0]}")


def check_cache_control(block: dict[str, Any], param: str) -> None:
    cc = block.get("cache_control")
    if cc is not None and (not isinstance(cc, dict) or cc.get("type") != "ephemeral"):
        raise bad("cache_control must be {\"type\": \"ephemeral\"} (the prefix cache is automatic)",
                  f"{param}.cache_control")


def _text_of(block: dict[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad("a text block needs text", f"{param}.text")
    if not unset(block.get("citations")):
        raise bad("citations are not supported", f"{param}.citations")
    check_cache_control(block, param)
    return text


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad("content must be a string or a list of content blocks", param)
    return content


def _image(block: dict[str, Any], param: str) -> dict[str, Any]:
    check_cache_control(block, param)
    if not unset(block.get("transformations")):
        raise bad("image transformations are not supported", f"{param}.transformations")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind in ("url", "file"):
        raise bad(f"image sources of type {kind!r} are not fetched: send the image as base64",
                  f"{param}.source.type")
    if kind != "base64":
        raise bad("an image needs a base64 source", f"{param}.source")
    media = source.get("media_type")
    if media not in IMAGE_TYPES:
        raise bad(f"media_type must be one of {', '.join(IMAGE_TYPES)}", f"{param}.source.media_type")
    data = source.get("data")
    if not isinstance(data, str):
        raise bad("a base64 source needs data", f"{param}.source.data")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _tool_result(block: dict[str, Any], param: str) -> tuple[str, list[dict[str, Any]]]:
    """The tool message's text, and the images the result holds (they follow as a user turn)."""
    check_cache_control(block, param)
    content = block.get("content", "")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    for j, part in enumerate(_blocks(content, f"{param}.content")):
        where = f"{param}.content.{j}"
        kind = part.get("type")
        if kind == "text":
            texts.append(_text_of(part, where))
        elif kind == "image":
            images.append(_image(part, where))
        else:
            raise bad("a tool_result holds text and image blocks only", f"{where}.type")
    text = "\n".join(texts)
    if block.get("is_error"):
        text = f"Error: {text}"
    return text, images


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    check_cache_control(block, param)
    name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise bad("a tool_use block needs id and name", param)
    if not isinstance(args, dict):
        raise bad("a tool_use block's input must be an object", f"{param}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _turns(messages: list[dict[str, Any]]) -> list[tuple[str, list[tuple[str, dict[str, Any]]]]]:
    """Consecutive messages of one role as one turn (as Anthropic combines them), each block with
    its path."""
    turns: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = []
    for i, message in enumerate(messages):
        param = f"messages.{i}"
        if not isinstance(message, dict):
            raise bad("a message must be an object with role and content", param)
        role = message.get("role")
        if role in ("ctx", "msg"):  # what Claude Code sends for context it adds (vllm#35372)
            role = "user"
        if role not in ("user", "assistant", "system"):  # system: a turn of instructions where it stands
            raise bad("a message's role must be user, assistant or system", f"{param}.role")
        only_keys(message, {"role", "content", "output_config"}, param)  # a turn's own effort: request.turn_effort
        content = _blocks(message.get("content"), f"{param}.content")
        if not content:
            raise bad("a message's content must not be empty", f"{param}.content")
        blocks = [(f"{param}.content.{j}", b) for j, b in enumerate(content)]
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    return turns


def chat_messages(system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]], origin: dict[str, str]) -> list[dict[str, Any]]:
    """The conversation as chat messages (system first), recording in ``origin`` the Anthropic
    path of each chat message and content part."""
    out: list[dict[str, Any]] = []
    text = _system(system)
    if text:
        out.append({"role": "system", "content": text})
    if not messages:
        raise bad("messages must not be empty", "messages")
    for role, blocks in _turns(messages):
        parts: list[tuple[dict[str, Any], str]] = []  # chat content parts, with their paths
        calls, reasoning, images_after = [], [], []
        for param, block in blocks:
            kind = block.get("type")
            if kind == "text":
                parts.append(({"type": "text", "text": _text_of(block, param)}, param))
            elif role == "system":
                raise bad("a system message holds text blocks only", f"{param}.type")
            elif kind == "image":
                if role != "user":
                    raise bad("only user messages may hold images", f"{param}.type")
                parts.append((_image(block, param), param))
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad("a tool_result needs tool_use_id", f"{param}.tool_use_id")
                text, images = _tool_result(block, param)
                origin[f"messages.{len(out)}"] = param
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
                images_after += [(image, param) for image in images]
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_use(block, param))
            elif kind == "thinking" and role == "assistant":
                if not isinstance(block.get("thinking"), str):
                    raise bad("a thinking block needs thinking", f"{param}.thinking")
                reasoning.append(block["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # another model's encrypted thinking: nothing this model can read
            elif kind in SERVED_BLOCKS:
                raise bad(f"{kind} blocks belong in {'assistant' if role == 'user' else 'user'} messages",
                          f"{param}.type")
            else:
                raise bad(f"content blocks of type {str(kind)[:40]!r} are not supported", f"{param}.type")
        parts = images_after + parts
        if not (parts or calls or reasoning):
            continue
        message: dict[str, Any] = {"role": role}
        at = len(out)
        origin[f"messages.{at}"] = parts[0][1].rsplit(".content.", 1)[0] if parts else f"messages.{at}"
        for j, (_, param) in enumerate(parts):
            origin[f"messages.{at}.content.{j}"] = param
        if all(part["type"] == "text" for part, _ in parts):
            message["content"] = "".join(part["text"] for part, _ in parts)
        else:
            message["content"] = [part for part, _ in parts]
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
        out.append(message)
    return out


def _system(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for i, block in enumerate(system):
        if block.get("type") != "text":
            raise bad("system blocks must be text blocks", f"system.{i}.type")
        text = _text_of(block, f"system.{i}")
        if not text.startswith(BILLING_HEADER):
            texts.append(text)
    return "\n".join(texts)
