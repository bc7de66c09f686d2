"""One tool-call object read character by character as a model writes it, so that its name is
known as soon as it is written and its arguments can stream on."""

from __future__ import annotations

import json

WS = " \t\r\n"


class NotACall(ValueError):
    """The text after a call marker is not a call object."""


class CallReader:
    """One call object, char by char: ``{"name": "f", "arguments": {...}}`` (the arguments may
    also be called "parameters", or be a JSON string), or with ``args_only`` the arguments object
    itself. Arguments stream out once the name is known; ``done`` once the object is closed."""

    NAME_KEYS = ("name",)
    ARG_KEYS = ("arguments", "parameters")

    def __init__(self, name: str | None = None, *, args_only: bool = False) -> None:
        self.name = name
        self.args_only = args_only
        self.out: list[str] = []  # argument text not yet handed out
        self.args_seen = args_only
        self.done = False
        self.raw = ""
        self._depth = 0
        self._in_string = self._escape = False
        self._expect = "open"  # open | key | colon | value | comma
        self._key_raw = ""
        self._key = ""
        self._value = ""
        self._value_string = False  # the arguments came as a JSON string: decoded at the end

    def feed(self, ch: str) -> None:
        self.raw += ch
        if self._expect == "open":
            if ch in WS:
                return
            if ch != "{":
                raise NotACall(f"expected '{{', got {ch!r}")
            self._depth, self._expect = 1, "key"
            if self.args_only:
                self.out.append(ch)
            return
        if self.args_only:
            self.out.append(ch)
            self._track(ch)
            if self._depth == 0:
                self.done = True
            return
        if self._expect == "value":
            self._value_char(ch)
            return
        if self._in_string:  # a key
            self._key_raw += ch
            self._track(ch)
            if not self._in_string:
                self._key = json.loads(self._key_raw)
                self._expect = "colon"
            return
        if ch in WS:
            return
        if self._expect == "key" and ch == '"':
            self._key_raw = ch
            self._in_string = True
        elif self._expect == "colon" and ch == ":":
            self._expect, self._value = "value", ""
        elif self._expect in ("comma", "key") and ch == "}":
            self._depth, self.done = 0, True
            if not self.args_seen:
                self.out.append("{}")
        elif self._expect == "comma" and ch == ",":
            self._expect = "key"
        else:
            raise NotACall(f"unexpected {ch!r} in a call object")

    def _value_char(self, ch: str) -> None:
        if not self._value and ch in WS:
            return
        if not self._value and self._key in self.ARG_KEYS:
            self.args_seen = True
            self._value_string = ch == '"'
        primitive = not self._value or self._value[0] not in '{["'
        if primitive and self._depth == 1 and not self._in_string and ch in ",}" + WS and self._value:
            self._end_value()
            if ch not in WS:
                self.feed_structural(ch)
            return
        self._value += ch
        if self._key in self.ARG_KEYS and not self._value_string:
            self.out.append(ch)
        self._track(ch)
        if self._depth == 1 and not self._in_string and self._value[0] in '{["':
            self._end_value()

    def feed_structural(self, ch: str) -> None:
        """A ',' or '}' that ended a primitive value."""
        self.raw = self.raw[:-1]
        self.feed(ch)

    def _end_value(self) -> None:
        if self._key in self.NAME_KEYS:
            value = json.loads(self._value)
            if not isinstance(value, str):
                raise NotACall("a call's name must be a string")
            self.name = value
        elif self._key in self.ARG_KEYS and self._value_string:
            self.out.append(json.loads(self._value))
        self._expect, self._key = "comma", ""

    def _track(self, ch: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
