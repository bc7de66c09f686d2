"""Stop strings over a text stream: text that could be the start of a stop string is held
back until it is known not to be one, so a client never sees any part of a stop string (unless
it asked for the stop string in the output)."""

from __future__ import annotations

from typing import Callable


class StopMatcher:
    """``include``: the stop string that ends the text is part of it (vLLM's
    ``include_stop_str_in_output``). ``armed``: stop strings count only once it says so (vLLM's
    ``min_tokens``: none before that many tokens); until then text passes straight through."""

    def __init__(self, stops: list[str], *, include: bool = False, armed: Callable[[], bool] | None = None) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self.armed = armed
        self.held = ""
        self.hit: str | None = None  # the stop string that ended the text (Anthropic's stop_sequence)

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        if self.armed is not None and not self.armed():
            out, self.held = self.held + text, ""
            return out, False
        buf = self.held + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            at, stop = min(hits)
            self.held = ""
            self.hit = stop
            return buf[: at + len(stop)] if self.include else buf[:at], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
