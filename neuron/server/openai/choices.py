"""One choice of a response: its output state's event stream turned into deltas of content,
reasoning and tool calls. Streaming sends each delta as it comes; a whole response folds the
same deltas, so both are views of one stream."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from neuron.server.output.state import OutputState, TokenEvent
from protocol.engine_client import FinishEvent

from neuron.parsing.reasoning import ReasoningSplitter
from neuron.parsing.tool_calls import CallArgs, CallStart, ToolCallParser


@dataclass
class Delta:
    index: int
    content: str = ""
    reasoning: str = ""
    calls: list[CallStart | CallArgs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] | None = None  # per token: (chosen, lp), then the top ones
    finish: FinishEvent | None = None
    reason: str | None = None  # the finish reason the client sees

    @property
    def empty(self) -> bool:
        return not (self.content or self.reasoning or self.calls or self.token_ids or self.finish)


@dataclass
class Choice:
    index: int
    req: OutputState
    prompt_tokens: int
    echo: str = ""  # text the choice starts with (echo)
    thinking: ReasoningSplitter | None = None
    tools: ToolCallParser | None = None
    include_reasoning: bool = True
    calls: int = 0
    generated: int = 0

    def start(self) -> Delta:
        """The delta before any token: the echoed text, if any."""
        return Delta(self.index, content=self.echo)

    def on_token(self, ev: TokenEvent) -> Delta:
        self.generated += len(ev.token_ids)
        delta = Delta(self.index, token_ids=list(ev.token_ids), logprobs=ev.logprobs)
        self._text(delta, ev.text, final=False)
        return delta

    def on_finish(self, fin: FinishEvent) -> Delta:
        delta = Delta(self.index, finish=fin)
        self._text(delta, "", final=True)
        reason = fin.reason
        if reason == "stop" and self.calls:
            reason = "tool_calls"
        elif reason == "stop" and getattr(self.req.constraint, "closed_early", False):
            reason = "length"  # the budget ended the structured output, not the model
        delta.reason = reason
        return delta

    def _text(self, delta: Delta, text: str, final: bool) -> None:
        reasoning, content = "", text
        if self.thinking is not None:
            reasoning, content = self.thinking.push(text)
            if final:
                more_reasoning, more_content = self.thinking.flush()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.include_reasoning:
            delta.reasoning = reasoning
        if self.tools is None:
            delta.content = content
            return
        events = self.tools.push(content) if content else []
        if final:
            events += self.tools.flush()
        for ev in events:
            if isinstance(ev, str):
                delta.content += ev
            else:
                delta.calls.append(ev)
                if isinstance(ev, CallStart):
                    self.calls += 1


class Merged:
    """The events of every choice in the order they come. ``next`` gives None once every choice
    has finished; ``close`` stops listening."""

    def __init__(self, choices: list[Choice]) -> None:
        self.queue: asyncio.Queue[tuple[Choice, TokenEvent | FinishEvent]] = asyncio.Queue()
        self.open = len(choices)
        # One choice (the usual case) is read straight from its queue: no task hop per token.
        self.only = choices[0] if len(choices) == 1 else None
        self.held: TokenEvent | FinishEvent | None = None
        self.tasks = [] if self.only else [asyncio.ensure_future(self._pump(c)) for c in choices]

    async def _pump(self, choice: Choice) -> None:
        while True:
            ev = await choice.req.events.get()
            self.queue.put_nowait((choice, ev))
            if isinstance(ev, FinishEvent):
                return

    async def next(self) -> tuple[Choice, TokenEvent | FinishEvent] | None:
        if not self.open:
            return None
        if self.only is not None:
            choice, ev = self.only, await self._next_of(self.only)
        else:
            choice, ev = await self.queue.get()
        if isinstance(ev, FinishEvent):
            self.open -= 1
        return choice, ev

    async def _next_of(self, choice: Choice) -> TokenEvent | FinishEvent:
        """The choice's next event; tokens already queued behind it come merged (a stream whose
        writer fell behind catches up in one chunk)."""
        events = choice.req.events
        ev = self.held or await events.get()
        self.held = None
        while isinstance(ev, TokenEvent) and not events.empty():
            more = events.get_nowait()
            if not isinstance(more, TokenEvent):
                self.held = more
                break
            ev = TokenEvent(ev.text + more.text, ev.token_ids + more.token_ids,
                            (ev.logprobs or []) + (more.logprobs or []) or None)
        return ev

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
