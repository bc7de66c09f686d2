"""A streamed event stays one line for clients that split with ``str.splitlines`` (httpx's
``aiter_lines``): text a model drew with U+0085, U+2028 or U+2029 goes out escaped."""

from __future__ import annotations

import json

import httpx

from neuron.server.messages.view import event
from neuron.server.openai.generation import data

TEXT = "a\u2028b\u0085c\u2029d \u00e9"


def lines_of(body: bytes) -> list[str]:
    """What httpx hands a client reading the stream line by line."""
    return [line for line in httpx.Response(200, content=body).iter_lines() if line]


def test_chat_and_completions_chunks_are_one_line_each():
    body = data({"choices": [{"delta": {"content": TEXT}}]}) + b"data: [DONE]\n\n"
    first, done = lines_of(body)
    assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["content"] == TEXT
    assert done == "data: [DONE]" and "\u00e9" in first  # other text as it is


def test_messages_events_are_one_line_each():
    kind, payload = lines_of(event("content_block_delta", {"delta": {"type": "text_delta", "text": TEXT}}))
    assert kind == "event: content_block_delta"
    assert json.loads(payload.removeprefix("data: "))["delta"]["text"] == TEXT
