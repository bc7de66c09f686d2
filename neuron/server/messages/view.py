"""How a message's deltas look in Anthropic's wire format (a StreamView): content blocks opened as
their first piece arrives (``thinking``, ``text``, ``tool_use``), their deltas streamed
(``thinking_delta``, ``text_delta``, ``input_json_delta``), each stopped before the next starts;
``message_start`` and ``message_delta`` carry the usage, ``ping`` keeps a quiet stream alive, an
``error`` event ends a failed one. The same machine builds the whole message object."""

from __future__ import annotations

import json
import secrets
from typing import Any

from neuron.errors import ApiError

from neuron.server.messages.errors import anthropic_error
from neuron.server.sse import json_text
from neuron.server.openai.choices import Choice, Delta
from neuron.server.openai.generation import usage
from neuron.server.openai.views import Folded
from neuron.parsing.tool_calls import CallStart

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json_text({'type': kind, **payload})}\n\n".encode()


def anthropic_usage(choices: list[Choice]) -> dict[str, int]:
    """Anthropic counts a prompt in three parts: read from the cache, written to it (nothing is
    charged for that here: 0), and the rest (``input_tokens``)."""
    u = usage(choices)
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


class MessageView:
    def __init__(self, model: str, show_thinking: bool = True, context_end: bool = False,
                 applied_edits: list[dict[str, Any]] | None = None) -> None:
        self.id = "msg_" + secrets.token_hex(12)
        self.model = model
        self.show_thinking = show_thinking
        self.context_end = context_end  # max_tokens was cut to the context's room: "length" is its end
        self.applied_edits = applied_edits  # context_management's, when the request had it
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.arguments: dict[int, str] = {}  # a tool_use block's input as the model wrote it, by block
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    # StreamView
    def opening(self, choices: list[Choice]) -> list[bytes]:
        shell = self._message(choices, [])
        shell["usage"]["output_tokens"] = 0
        return [event("message_start", {"message": shell}), self.keepalive()]

    def keepalive(self) -> bytes:
        return event("ping", {})

    def frames(self, delta: Delta, choices: list[Choice]) -> list[bytes]:
        out: list[bytes] = []
        if delta.reasoning:
            out += self._write("thinking", delta.reasoning)
        if delta.content:
            out += self._write("text", delta.content)
        for ev in delta.calls:
            if isinstance(ev, CallStart):
                out += self._close()
                out += self._start({"type": "tool_use", "id": "toolu_" + ev.id.removeprefix("call_"),
                                    "name": ev.name, "input": {}})
                self.arguments[len(self.blocks) - 1] = ""
            elif self.open is not None and self.open["type"] == "tool_use":
                self.arguments[len(self.blocks) - 1] += ev.text
                out.append(self._delta({"type": "input_json_delta", "partial_json": ev.text}))
        if delta.reason is not None:
            out += self._close()
            hit = choices[0].req.stop_matcher.hit
            self.stop_reason = "stop_sequence" if hit is not None and delta.reason == "stop" else \
                "model_context_window_exceeded" if delta.reason == "length" and self.context_end else \
                STOP_REASONS.get(delta.reason, "end_turn")
            self.stop_sequence = hit if self.stop_reason == "stop_sequence" else None
        return out

    def closing(self, choices: list[Choice], failed: ApiError | None) -> list[bytes]:
        if failed is not None:
            return [event("error", anthropic_error(failed))]
        out = self._close()
        last = {"delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                "usage": anthropic_usage(choices)}
        if self.applied_edits is not None:
            last["context_management"] = {"applied_edits": self.applied_edits}
        out.append(event("message_delta", last))
        return out + [event("message_stop", {})]

    def body(self, folded: list[Folded], choices: list[Choice]) -> dict[str, Any]:
        self.frames(folded[0].as_delta(), choices)
        for i, text in self.arguments.items():
            self.blocks[i]["input"] = _input(text)
        return self._message(choices, self.blocks)

    # the machine
    def _message(self, choices: list[Choice], content: list[dict[str, Any]]) -> dict[str, Any]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                   "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                   "usage": anthropic_usage(choices)}
        if self.applied_edits is not None:
            message["context_management"] = {"applied_edits": self.applied_edits}
        return message

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        self.blocks.append(block)
        self.open = block
        return [event("content_block_start", {"index": len(self.blocks) - 1, "content_block": dict(block)})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": len(self.blocks) - 1, "delta": delta})

    def _write(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            out += self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                               else {"type": "text", "text": ""})
        if kind == "thinking" and not self.show_thinking:
            return out  # display "omitted": the block and its signature, not its text
        assert self.open is not None
        self.open[kind] += text
        return out + [self._delta({"type": f"{kind}_delta", kind: text})]

    def _close(self) -> list[bytes]:
        block, self.open = self.open, None
        if block is None:
            return []
        out = []
        if block["type"] == "thinking":
            # Anthropic's signature lets its API check the thinking it gets back; neuron reads
            # earlier thinking as the model's own text and checks nothing, so this only marks it.
            block["signature"] = "neuron-" + secrets.token_hex(8)
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        return out + [event("content_block_stop", {"index": len(self.blocks) - 1})]


def _input(arguments: str) -> dict[str, Any]:
    """A tool_use block's input: the model's JSON object (a call cut off by max_tokens may not be
    whole JSON; its input is then empty, and stop_reason says max_tokens)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
