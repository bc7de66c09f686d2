"""The API side's state of one sequence (``protocol.engine_client.Submitted``): the request it
handed its engine, its constraint, and what turns the drawn ids into the events its route
streams. The engine decides which tokens a sequence draws and when it ends by token (a stop id,
``max_tokens``, the context's end); this side detokenizes, holds back text that could begin a
stop string, and says when a stop string ended the text (the engine then ends the sequence).
Streaming and non-streaming responses are two views of the same event stream."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from protocol.api_core import EngineRequest
from protocol.engine_client import FinishEvent, TokenConstraint

from .detokenizer import Detokenizer
from .stops import StopMatcher


@dataclass
class TokenEvent:
    text: str
    token_ids: list[int]
    logprobs: list[list[tuple[int, float]]] | None = None


Event = TokenEvent | FinishEvent


@dataclass(eq=False)  # a sequence is itself: it keys the engine client's map of those running
class OutputState:
    wire: EngineRequest
    detokenizer: Detokenizer
    stop_matcher: StopMatcher
    constraint: TokenConstraint | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    output: list[int] = field(default_factory=list)
    admitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    arrival: float = field(default_factory=time.monotonic)
    cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache
    finished: bool = False

    @property
    def request_id(self) -> str:
        return self.wire.request_id

    @property
    def prompt(self) -> list[int]:
        return self.wire.prompt

    def admit(self, cached_tokens: int, error: BaseException | None = None) -> None:
        if self.admitted.done():
            return
        if error is not None:
            self.finished = True
            self.admitted.set_exception(error)
        else:
            self.cached_tokens = cached_tokens
            self.admitted.set_result(True)

    def token(self, token: int, logprobs: list[tuple[int, float]] | None, end: int) -> bool:
        """Emit the text ``token`` adds; True where a stop string ended the text with it. ``end``
        1: the engine ends the sequence with this token, so everything held back goes out with
        it; 2: the token is a stop id, whose text is not shown (what was held back is)."""
        self.output.append(token)
        if end == 2:
            self._emit(self.stop_matcher.flush(), token, logprobs)
            return False
        text, hit = self.stop_matcher.push(self.detokenizer.push(token))
        if not hit and end:
            text += self.stop_matcher.push(self.detokenizer.flush())[0] + self.stop_matcher.flush()
        self._emit(text, token, logprobs)
        return hit

    def _emit(self, text: str, token: int, logprobs: list[tuple[int, float]] | None) -> None:
        self.events.put_nowait(TokenEvent(text, [token], [logprobs] if logprobs else None))

    def finish(self, event: FinishEvent) -> None:
        self.finished = True
        self.events.put_nowait(event)
        if not self.admitted.done():
            self.admitted.set_result(True)
