"""How the Engine's events look on the wire: chat and text completion objects, streamed as
chunks or returned whole. One event stream, two projections."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenizers import Tokenizer

from neuron.engine.request import FinishEvent, TokenEvent


def _token_text(tk: Tokenizer, token_id: int) -> str:
    return tk.decode([token_id], skip_special_tokens=False)


@dataclass
class View:
    model: str
    tokenizer: Tokenizer
    top_logprobs: int | None  # None: no logprobs asked
    return_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    prefix: ClassVar[str] = "cmpl"

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.offset = 0  # characters of completion text so far, for text_offset

    def _with_ids(self, body: dict[str, Any], events: list[TokenEvent]) -> dict[str, Any]:
        """``return_token_ids``: the generated ids, whole or per chunk (a streamed chunk is sent for
        every token then, also one whose text is still held back by the detokenizer)."""
        if self.return_token_ids:
            body["choices"][0]["token_ids"] = [t for ev in events for t in ev.token_ids]
        return body

    def usage(self, fin: FinishEvent) -> dict[str, Any]:
        return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
                "total_tokens": fin.prompt_tokens + fin.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


class ChatView(View):
    prefix = "chatcmpl"

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def first(self) -> dict[str, Any] | None:
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, ev: TokenEvent) -> dict[str, Any] | None:
        lp = self._logprobs(ev)
        if not ev.text and lp is None and not self.return_token_ids:
            return None
        return self._with_ids(self._chunk({"content": ev.text}, logprobs=lp), [ev])

    def finish(self, fin: FinishEvent) -> dict[str, Any]:
        return self._chunk({}, fin.reason)

    def usage_chunk(self, fin: FinishEvent) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage(fin)}

    def whole(self, text: str, events: list[TokenEvent], fin: FinishEvent) -> dict[str, Any]:
        lp = None
        if self.top_logprobs is not None:
            lp = {"content": [c for ev in events for c in (self._logprobs(ev) or {}).get("content", [])]}
        return self._with_ids({"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                             "finish_reason": fin.reason}],
                "usage": self.usage(fin)}, events)

    def _logprobs(self, ev: TokenEvent) -> dict[str, Any] | None:
        if self.top_logprobs is None or not ev.logprobs:
            return None
        content = []
        for entry in ev.logprobs:
            (chosen, lp), top = entry[0], entry[1:]
            text = _token_text(self.tokenizer, chosen)
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                            "top_logprobs": [{"token": (t := _token_text(self.tokenizer, i)), "logprob": v,
                                              "bytes": list(t.encode())} for i, v in top]})
        return {"content": content}


class CompletionView(View):
    prefix = "cmpl"

    def _chunk(self, text: str, finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    def first(self) -> dict[str, Any] | None:
        return None

    def delta(self, ev: TokenEvent) -> dict[str, Any] | None:
        lp = self._logprobs(ev)
        if not ev.text and lp is None and not self.return_token_ids:
            return None
        return self._with_ids(self._chunk(ev.text, logprobs=lp), [ev])

    def finish(self, fin: FinishEvent) -> dict[str, Any]:
        return self._chunk("", fin.reason)

    def usage_chunk(self, fin: FinishEvent) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage(fin)}

    def whole(self, text: str, events: list[TokenEvent], fin: FinishEvent) -> dict[str, Any]:
        lp = None
        if self.top_logprobs is not None:
            self.offset = 0
            parts = [self._logprobs(ev) for ev in events]
            lp = {k: [x for part in parts if part for x in part[k]]
                  for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        return self._with_ids({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": fin.reason}],
                "usage": self.usage(fin)}, events)

    def _logprobs(self, ev: TokenEvent) -> dict[str, Any] | None:
        if self.top_logprobs is None or not ev.logprobs:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in ev.logprobs:
            (chosen, lp), top = entry[0], entry[1:]
            text = _token_text(self.tokenizer, chosen)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({_token_text(self.tokenizer, i): v for i, v in top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
