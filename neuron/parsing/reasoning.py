"""Reasoning models: the thinking text between the template's markers (``<think>...</think>`` and
its kin) goes to ``reasoning_content``, the rest to ``content``. Which markers a model uses is
configured per model (``reasoning_parser``) or, by default, found in its chat template."""

from __future__ import annotations

from dataclasses import dataclass

from neuron.parsing.markers import split_at


@dataclass(frozen=True)
class ThinkMarkers:
    start: str
    end: str


# Searched in this order: '<seed:think>' contains 'think>'.
KNOWN_MARKERS: dict[str, ThinkMarkers] = {
    "seed": ThinkMarkers("<seed:think>", "</seed:think>"),
    "think": ThinkMarkers("<think>", "</think>"),
    "mistral": ThinkMarkers("[THINK]", "[/THINK]"),
    "kimi": ThinkMarkers("◁think▷", "◁/think▷"),
}


def reasoning_markers(setting: str, template: str | None) -> ThinkMarkers | None:
    """The markers of ``setting``; for "auto", the first known pair the template mentions."""
    if setting == "none":
        return None
    if setting != "auto":
        return KNOWN_MARKERS[setting]
    return next((m for m in KNOWN_MARKERS.values() if template and m.start in template), None)


def starts_thinking(prompt: str, markers: ThinkMarkers) -> bool | None:
    """Whether the rendered prompt leaves the model inside its thinking (the template opened it),
    outside (the template closed it: thinking off), or None: the output's start will say."""
    tail = prompt.rstrip()
    if tail.endswith(markers.end):
        return False
    if tail.endswith(markers.start):
        return True
    return None


class ReasoningSplitter:
    """Splits generated text into (reasoning, content) piece by piece."""

    def __init__(self, markers: ThinkMarkers, thinking: bool | None) -> None:
        self.markers = markers
        self.state = {True: "thinking", False: "content", None: "start"}[thinking]
        self.held = ""

    def push(self, text: str) -> tuple[str, str]:
        buf, self.held = self.held + text, ""
        reasoning = content = ""
        while buf:
            if self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(self.markers.start):
                    buf, self.state = stripped[len(self.markers.start):], "thinking"
                elif self.markers.start.startswith(stripped):
                    self.held = buf  # whitespace, or the start of a start marker: wait
                    break
                else:
                    self.state = "content"
            elif self.state == "thinking":
                before, found, buf = split_at(buf, self.markers.end)
                reasoning += before
                if not found:
                    self.held = buf
                    break
                self.state = "after"
            elif self.state == "after":  # templates put blank lines after the end marker
                buf = buf.lstrip()
                if buf:
                    self.state = "content"
            else:
                content, buf = content + buf, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held, ""
        return "", held if self.state in ("start", "content") else ""
