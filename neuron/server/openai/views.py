"""How the deltas of a response's choices look on the wire: chat and text completion objects,
streamed as chunks or returned whole. One stream of deltas, two projections."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenizers import Tokenizer

from neuron.loader.tokenizer import byte_alphabet

from neuron.server.openai.choices import Delta
from neuron.parsing.tool_calls import CallArgs, CallStart

_BYTES = {c: b for b, c in byte_alphabet().items()}


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Folded:
    """A choice's deltas added up: what a whole (non-streamed) response shows."""

    content: str = ""
    reasoning: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.content += delta.content
        self.reasoning += delta.reasoning
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        for ev in delta.calls:
            if isinstance(ev, CallStart):
                self.calls.append({"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}})
            else:
                self.calls[ev.index]["function"]["arguments"] += ev.text
        if delta.reason is not None:
            self.reason = delta.reason

    def as_delta(self, index: int = 0) -> Delta:
        """Everything as one delta: a whole answer run through a streaming view's machine."""
        delta = Delta(index, content=self.content, reasoning=self.reasoning, reason=self.reason)
        for i, call in enumerate(self.calls):
            delta.calls += [CallStart(i, call["id"], call["function"]["name"]),
                            CallArgs(i, call["function"]["arguments"])]
        return delta


@dataclass
class View:
    model: str
    tokenizer: Tokenizer
    top_logprobs: int | None  # None: no logprobs asked
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # return_tokens_as_token_ids
    request_id: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    prefix: ClassVar[str] = "cmpl"
    kind: ClassVar[str] = "text_completion"

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{self.request_id or uuid.uuid4().hex[:24]}"
        self._token_text: dict[int, tuple[str, list[int]]] = {}

    def _frame(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        body = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage.as_dict()
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._frame([], usage)

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and bytes for logprobs (bytes, not text: a token may be half a character)."""
        found = self._token_text.get(token_id)
        if found is None:
            piece = self.tokenizer.id_to_token(token_id) or ""
            if piece and all(c in _BYTES for c in piece):  # byte-level BPE
                raw = bytes(_BYTES[c] for c in piece)
            else:
                raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
            text = f"token_id:{token_id}" if self.tokens_as_ids else raw.decode("utf-8", errors="replace")
            found = self._token_text[token_id] = (text, list(raw))
        return found

    def first(self, indices: list[int], echoes: dict[int, str]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def chunk(self, delta: Delta, usage: Usage | None) -> dict[str, Any] | None:
        raise NotImplementedError

    def whole(self, folded: list[Folded], usage: Usage) -> dict[str, Any]:
        raise NotImplementedError


class ChatView(View):
    prefix = "chatcmpl"
    kind = "chat.completion.chunk"

    def first(self, indices: list[int], echoes: dict[int, str]) -> list[dict[str, Any]]:
        return [self._frame([{"index": i, "delta": {"role": "assistant", "content": echoes.get(i, "")},
                              "logprobs": None, "finish_reason": None}]) for i in indices]

    def chunk(self, delta: Delta, usage: Usage | None) -> dict[str, Any] | None:
        lp = self._logprobs(delta.logprobs)
        if delta.empty and lp is None:
            return None
        body: dict[str, Any] = {}
        if delta.reasoning:
            body["reasoning_content"] = delta.reasoning
        if delta.content or (not delta.reasoning and not delta.calls and delta.finish is None):
            body["content"] = delta.content
        if delta.calls:
            body["tool_calls"] = _call_deltas(delta.calls)
        choice: dict[str, Any] = {"index": delta.index, "delta": body, "logprobs": lp, "finish_reason": delta.reason}
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return self._frame([choice], usage)

    def whole(self, folded: list[Folded], usage: Usage) -> dict[str, Any]:
        choices = []
        for i, f in enumerate(folded):
            message: dict[str, Any] = {"role": "assistant", "content": f.content or (None if f.calls else "")}
            if f.reasoning:
                message["reasoning_content"] = f.reasoning
            if f.calls:
                message["tool_calls"] = f.calls
            choice: dict[str, Any] = {"index": i, "message": message, "logprobs": self._logprobs(f.logprobs)
                                      if self.top_logprobs is not None else None, "finish_reason": f.reason}
            if self.return_token_ids:
                choice["token_ids"] = f.token_ids
            choices.append(choice)
        return {**self._frame(choices, usage), "object": "chat.completion"}

    def _logprobs(self, entries: list[list[tuple[int, float]]] | None) -> dict[str, Any] | None:
        if self.top_logprobs is None or entries is None:
            return None
        content = []
        for (chosen, lp), *top in entries:
            text, raw = self.token(chosen)
            content.append({"token": text, "logprob": lp, "bytes": raw,
                            "top_logprobs": [{"token": self.token(i)[0], "logprob": v, "bytes": self.token(i)[1]}
                                             for i, v in top[: self.top_logprobs]]})
        return {"content": content, "refusal": None}


def _call_deltas(calls: list[CallStart | CallArgs]) -> list[dict[str, Any]]:
    """OpenAI's tool_calls deltas: the first of a call has its id, type and name; arguments follow."""
    out: list[dict[str, Any]] = []
    for ev in calls:
        if isinstance(ev, CallStart):
            out.append({"index": ev.index, "id": ev.id, "type": "function",
                        "function": {"name": ev.name, "arguments": ""}})
        elif out and out[-1]["index"] == ev.index:
            out[-1]["function"]["arguments"] += ev.text
        else:
            out.append({"index": ev.index, "function": {"arguments": ev.text}})
    return out


class CompletionView(View):
    prefix = "cmpl"
    kind = "text_completion"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.offsets: dict[int, int] = {}  # characters of each choice's text so far, for text_offset

    def first(self, indices: list[int], echoes: dict[int, str]) -> list[dict[str, Any]]:
        out = []
        for i in indices:
            if echoes.get(i):
                self.offsets[i] = len(echoes[i])
                out.append(self._frame([{"index": i, "text": echoes[i], "logprobs": None, "finish_reason": None}]))
        return out

    def chunk(self, delta: Delta, usage: Usage | None) -> dict[str, Any] | None:
        lp = self._logprobs(delta.index, delta.logprobs)
        if delta.empty and lp is None:
            return None
        choice: dict[str, Any] = {"index": delta.index, "text": delta.content, "logprobs": lp,
                                  "finish_reason": delta.reason}
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return self._frame([choice], usage)

    def whole(self, folded: list[Folded], usage: Usage) -> dict[str, Any]:
        choices = []
        for i, f in enumerate(folded):
            self.offsets[i] = 0
            choice: dict[str, Any] = {"index": i, "text": f.content, "logprobs": self._logprobs(i, f.logprobs),
                                      "finish_reason": f.reason}
            if self.return_token_ids:
                choice["token_ids"] = f.token_ids
            choices.append(choice)
        return self._frame(choices, usage)

    def _logprobs(self, index: int, entries: list[list[tuple[int, float]]] | None) -> dict[str, Any] | None:
        if self.top_logprobs is None or entries is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for (chosen, lp), *top in entries:
            text = self.token(chosen)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self.token(i)[0]: v for i, v in top[: self.top_logprobs]})
            out["text_offset"].append(self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(text)
        return out
