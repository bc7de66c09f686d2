"""One request's timeline on the leader's clock (arrival, admission to the batch, each token event
as the Engine emits it) and its two log lines, one at start and one at finish. Queue time,
TTFT and inter-token latency are measured here, never from rank clocks."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from neuron.server.output.state import OutputState, TokenEvent
from protocol.engine_client import FinishEvent

log = logging.getLogger("neuron.request")
MAX_FIELD = 256  # characters of a client-given field in a log line


class TracedEvents(asyncio.Queue):
    """A request's event queue that stamps the moment the Engine puts each token event on it
    (``Queue.put`` goes through ``put_nowait`` too)."""

    def __init__(self, trace: RequestTrace) -> None:
        super().__init__()
        self.trace = trace

    def put_nowait(self, item: Any) -> None:
        if isinstance(item, TokenEvent):
            self.trace.token_times.append(time.monotonic())
        super().put_nowait(item)


@dataclass
class RequestTrace:
    request_id: str
    model: str
    route: str
    admitted_at: float | None = None
    token_times: list[float] = field(default_factory=list)

    def attach(self, req: OutputState) -> None:
        """Before submit: the sequence reports its events through us."""
        req.events = TracedEvents(self)
        req.admitted.add_done_callback(self._on_admitted)

    def _on_admitted(self, fut: asyncio.Future) -> None:
        # The future also resolves when a request ends before it ever ran; that is no admission.
        if not fut.cancelled() and fut.exception() is None and self.admitted_at is None:
            self.admitted_at = time.monotonic()


def trace_of(req: OutputState) -> RequestTrace | None:
    events = req.events
    return events.trace if isinstance(events, TracedEvents) else None


def log_start(trace: RequestTrace, req: OutputState, stream: bool, user: str | None = None) -> None:
    fields: dict[str, Any] = {"request_id": trace.request_id, "model": trace.model, "route": trace.route,
                              "stream": stream, "prompt_tokens": len(req.prompt), "max_tokens": req.wire.max_tokens,
                              "principal": req.wire.principal}
    if user:  # the client's words: bounded, as every field of a log line is
        fields["user"] = user if len(user) <= MAX_FIELD else user[:MAX_FIELD] + "…(cut)"
    if req.wire.priority:
        fields["priority"] = req.wire.priority
    log.info("request started", extra=fields)


def log_finish(model: str, req: OutputState, fin: FinishEvent, trace: RequestTrace | None) -> None:
    now = time.monotonic()
    ttft = trace.token_times[0] - req.arrival if trace and trace.token_times else None
    queue = trace.admitted_at - req.arrival if trace and trace.admitted_at is not None else None
    fields: dict[str, Any] = {
        "request_id": req.request_id, "model": model, "principal": req.wire.principal, "finish_reason": fin.reason,
        "prompt_tokens": fin.prompt_tokens, "cached_tokens": fin.cached_tokens,
        "cached_host_tokens": fin.host_tokens, "cached_disk_tokens": fin.disk_tokens,
        "completion_tokens": fin.completion_tokens, "preemptions": fin.preemptions,
        "queue_s": None if queue is None else round(queue, 4),
        "ttft_s": None if ttft is None else round(ttft, 4), "duration_s": round(now - req.arrival, 4),
        "error": fin.error,
    }
    (log.warning if fin.error else log.info)("request finished", extra=fields)


def log_unserved(trace: RequestTrace, reason: str, status: int, code: str) -> None:
    """Ended before it ran (queue full, waited too long, model gone, client gone): the Engine
    never finishes such a request, so its finish line is written here."""
    log.info("request finished", extra={"request_id": trace.request_id, "model": trace.model,
                                        "finish_reason": reason, "status": status, "code": code})
