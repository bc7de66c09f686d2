"""A model's tool-call syntax read out of its streamed text: Hermes/Qwen ``<tool_call>{json}
</tool_call>``, Llama 3 JSON (``{"name": ..., "parameters": ...}``) and Mistral ``[TOOL_CALLS]``
(a JSON array, or ``name[ARGS]{json}``). Text arrives in pieces of any size; out come content
text and tool-call events: a call's start (id and name) as soon as its name is known, then its
arguments as the model writes them. The arguments are the model's own JSON text, the same
whether streamed or whole."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

from neuron.parsing.call_reader import WS as _WS
from neuron.parsing.call_reader import CallReader, NotACall
from neuron.parsing.markers import partial_at_end, split_at


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArgs:
    index: int
    text: str


Event = str | CallStart | CallArgs  # a str is content

class ToolCallParser:
    """The shared part of every syntax: call numbering, ids, the events of one call, content.
    Whitespace is held back until something follows it, so the gap before a call is not content."""

    def __init__(self, tool_names: set[str] | None = None) -> None:
        self.tool_names = tool_names
        self.max_calls: int | None = None  # parallel_tool_calls: false keeps the first call only
        self._muted = False
        self.calls = 0
        self.buf = ""
        self.reader: CallReader | None = None
        self._started = False
        self._ws = ""
        self.events: list[Event] = []

    def push(self, text: str) -> list[Event]:
        self.buf += text
        self._run(final=False)
        return self._take()

    def flush(self) -> list[Event]:
        self._run(final=True)
        if self.reader is not None:
            self._end_call(complete=False)
        if self.buf or (self._ws and not self.calls):
            self._content(self.buf, final=True)
            self.buf = ""
        return self._take()

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    def _take(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def _content(self, text: str, final: bool = False) -> None:
        text = self._ws + text
        body = text if final else text.rstrip(_WS)
        self._ws = text[len(body):]
        if body:
            self.events.append(body)

    def _new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def _begin_call(self, reader: CallReader) -> None:
        self.reader, self._started = reader, False

    def _feed_call(self) -> str:
        """Feed ``buf`` to the open call: "done" (closed), "more" (needs more text) or "failed"
        (it was not a call: its text is back at the front of ``buf``)."""
        reader = self.reader
        assert reader is not None
        try:
            while self.buf and not reader.done:
                ch, self.buf = self.buf[0], self.buf[1:]
                reader.feed(ch)
                if reader.name is not None and not self._started:
                    if self.tool_names is not None and reader.name not in self.tool_names:
                        raise NotACall(f"{reader.name!r} is not one of the tools")
                    self._muted = self.max_calls is not None and self.calls >= self.max_calls
                    if not self._muted:
                        self.events.append(CallStart(self.calls, self._new_id(), reader.name))
                    self._started, self._ws = True, ""  # the gap before a call is not content
                if self._started and reader.out:
                    if not self._muted:
                        self.events.append(CallArgs(self.calls, "".join(reader.out)))
                    reader.out.clear()
        except (NotACall, ValueError):
            if not self._started:
                self.reader = None
                self.buf = self._call_text(reader) + self.buf
                return "failed"
            self._end_call(complete=False)  # a call that went wrong half way stays a (broken) call
            return "done"
        if reader.done:
            self._end_call(complete=True)
            return "done"
        return "more"

    def _end_call(self, complete: bool) -> None:
        reader = self.reader
        assert reader is not None
        self.reader = None
        if not self._started:
            if not reader.raw.strip():
                return
            self._content(self._call_text(reader), final=True)  # no name: it was text after all
            return
        if self._muted:
            return
        if reader.out:
            self.events.append(CallArgs(self.calls, "".join(reader.out)))
        self.calls += 1

    def _call_text(self, reader: CallReader) -> str:
        return reader.raw


class HermesParser(ToolCallParser):
    """``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, any number of them."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: set[str] | None = None) -> None:
        super().__init__(tool_names)
        self.state = "text"

    def _call_text(self, reader: CallReader) -> str:
        return self.START + reader.raw

    def _run(self, final: bool) -> None:
        while self.buf:
            if self.state == "text":
                before, found, rest = split_at(self.buf, self.START)
                self._content(before)
                if not found:
                    self.buf = rest
                    return
                self.buf, self.state = rest, "call"
                self._begin_call(CallReader())
            elif self.state == "call":
                result = self._feed_call()
                if result == "more":
                    return
                if result == "failed":  # the marker was text: pass it on and read on after it
                    self._content(self.buf[: len(self.START)])
                    self.buf = self.buf[len(self.START):]
                self.state = "end" if result == "done" else "text"
            else:
                self.buf = self.buf.lstrip(_WS)
                if self.buf.startswith(self.END):
                    self.buf, self.state = self.buf[len(self.END):], "text"
                elif not self.buf or (self.END.startswith(self.buf) and not final):
                    return
                else:
                    self.state = "text"


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x: the answer is ``{"name": "f", "parameters": {...}}`` (after an optional
    ``<|python_tag|>``), several separated by ';'. An answer that is other JSON, or names no tool
    of the request, is content."""

    TAG = "<|python_tag|>"

    def __init__(self, tool_names: set[str] | None = None) -> None:
        super().__init__(tool_names or set())
        self.state = "start"

    def _run(self, final: bool) -> None:
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip(_WS)
                if stripped.startswith(self.TAG):
                    self.buf = stripped[len(self.TAG):]
                    continue
                if not stripped or (self.TAG.startswith(stripped) and not final):
                    return
                if stripped[0] == "{":
                    self.buf, self.state = stripped, "call"
                    self._begin_call(CallReader())
                else:
                    self.state = "content"
            elif self.state == "call":
                result = self._feed_call()
                if result == "more":
                    return
                self.state = "between" if result == "done" else "content"
            elif self.state == "between":
                self.buf = self.buf.lstrip(_WS + ";")
                if self.buf.startswith("{"):
                    self.state = "call"
                    self._begin_call(CallReader())
                elif self.buf:
                    self.state = "content"
            else:
                self._content(self.buf)
                self.buf = ""


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` or ``[TOOL_CALLS]f[ARGS]{...}``."""

    START, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, tool_names: set[str] | None = None) -> None:
        super().__init__(tool_names)
        self.state = "text"
        self.name = ""

    def _run(self, final: bool) -> None:
        while self.buf:
            if self.state == "text":
                before, found, rest = split_at(self.buf, self.START)
                self._content(before)
                self.buf = rest
                if not found:
                    return
                self.state = "calls"
            elif self.state == "calls":
                self.buf = self.buf.lstrip(_WS)
                if not self.buf:
                    return
                if self.buf[0] == "[":
                    self.buf, self.state = self.buf[1:], "array"
                else:
                    self.state, self.name = "name", ""
            elif self.state == "array":
                self.buf = self.buf.lstrip(_WS + ",")
                if not self.buf:
                    return
                if self.buf[0] == "]":
                    self.buf, self.state = self.buf[1:], "text"
                elif self.buf[0] == "{":
                    self._begin_call(CallReader())
                    self.state = "array_call"
                else:
                    self.state = "text"
            elif self.state == "array_call":
                result = self._feed_call()
                if result == "more":
                    return
                self.state = "array" if result == "done" else "text"
            elif self.state == "name":
                at_args, at_brace = self.buf.find(self.ARGS), self.buf.find("{")
                if at_brace >= 0 and (at_args < 0 or at_brace < at_args):  # 'name{...}', no [ARGS]
                    self.name, self.buf = self.name + self.buf[:at_brace], self.buf[at_brace:]
                elif at_args >= 0:
                    self.name, self.buf = self.name + self.buf[:at_args], self.buf[at_args + len(self.ARGS):]
                else:
                    keep = partial_at_end(self.buf, self.ARGS)
                    self.name, self.buf = self.name + self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    return
                self._begin_call(CallReader(self.name.strip(), args_only=True))
                self.state = "named_call"
            else:
                result = self._feed_call()
                if result == "more":
                    return
                self.state = "text"

    def _new_id(self) -> str:
        # Mistral's templates refuse tool call ids that are not 9 letters and digits.
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}

