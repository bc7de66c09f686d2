"""The Engine actor of one model: admission queue, the scheduler loop that turns requests into
steps for the RankGroup, and the per-request event streams."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import protocol as p
from neuron.config import EngineConfig
from neuron.errors import ApiError
from neuron.rankgroup import GroupFailed, RankError, RankGroup

from .request import FinishEvent, GenRequest, TokenEvent
from .scheduler import Planned, Scheduler

log = logging.getLogger("neuron.engine")


@dataclass
class EngineStats:
    running: int
    waiting: int
    slots_used: int
    slots_total: int
    steps: int
    tokens_generated: int
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found


class Engine:
    def __init__(self, model_id: str, cfg: EngineConfig, *, max_slots: int, max_len: int) -> None:
        self.model_id = model_id
        self.cfg = cfg
        self.max_len = max_len
        self.sched = Scheduler(max_slots, cfg.max_batch_tokens, cfg.prefill_chunk)
        self.group: RankGroup | None = None
        self.accepting = True
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self._step_ids = 0
        self._to_free: list[int] = []
        self.steps = 0
        self.tokens_generated = 0
        self.on_finish = None  # callable(req, FinishEvent) for metrics

    # ----------------------------------------------------------------------------- control
    def attach(self, group: RankGroup) -> None:
        self.group = group
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"engine-{self.model_id}")
        self._wake.set()

    def detach(self, reason: str, kind: str = "model_unavailable") -> None:
        """The group is gone: every request in flight or waiting ends now, with the reason."""
        self.group = None
        for req in list(self.sched.running) + list(self.sched.waiting):
            self._fail(req, reason, kind)
        self._to_free.clear()
        self.sched.free_slots.clear()
        self.sched.free_slots.extend(range(self.sched.max_slots))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    def submit(self, req: GenRequest) -> None:
        if not self.accepting:
            raise ApiError(503, "shutting_down", "the server is shutting down")
        if self.group is None:
            raise ApiError(503, "model_unavailable", f"model {self.model_id!r} is not ready", retry_after=5)
        if len(self.sched.waiting) >= self.cfg.queue_size:
            raise ApiError(429, "rate_limit_exceeded",
                           f"the queue of model {self.model_id!r} is full ({self.cfg.queue_size} waiting)",
                           retry_after=max(1, len(self.sched.running)))
        self.sched.waiting.append(req)
        self._idle.clear()
        self._wake.set()

    def abort(self, req: GenRequest) -> None:
        if not req.finished:
            req.abort()
            self._wake.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def stats(self) -> EngineStats:
        return EngineStats(len(self.sched.running), len(self.sched.waiting),
                           self.sched.max_slots - len(self.sched.free_slots), self.sched.max_slots,
                           self.steps, self.tokens_generated,
                           kv_usage=0.0, preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0)

    # ----------------------------------------------------------------------------- the loop
    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.group is not None and not self.sched.idle:
                try:
                    await self._iterate(self.group)
                except Exception as exc:  # a bug here must fail requests loudly, never strand them
                    log.exception("%s: scheduler iteration failed", self.model_id)
                    for req in list(self.sched.running) + list(self.sched.waiting):
                        self._fail(req, f"internal error in the scheduler: {type(exc).__name__}", "internal")
                    if self.group is not None:
                        self.group.fail(f"scheduler error: {exc}")
            if self.sched.idle:
                self._idle.set()

    async def _iterate(self, group: RankGroup) -> None:
        now = time.monotonic()
        for req in list(self.sched.running):
            if req.cancelled:
                self._finish(req, "abort")
        for req in list(self.sched.waiting):
            if req.cancelled:
                self.sched.release(req)
            elif now - req.arrival > self.cfg.max_queue_wait_s:
                self.sched.release(req)
                req.finished = True
                if not req.admitted.done():
                    req.admitted.set_exception(ApiError(
                        429, "rate_limit_exceeded", f"waited over {self.cfg.max_queue_wait_s:.0f}s for a free slot",
                        retry_after=5))
        for req in self.sched.admit():
            if not req.admitted.done():
                req.admitted.set_result(True)
        planned: list[Planned] = []
        try:
            if self._to_free:
                slots, self._to_free = self._to_free, []
                await group.free(slots)
            planned = self.sched.plan()
            if not planned:
                if self.sched.waiting:  # all slots busy with cancelled work just freed: loop again
                    await asyncio.sleep(0.01)
                return
            self._step_ids += 1
            seqs = [p.StepSeq(slot=x.req.slot, tokens=x.tokens, start_pos=x.start_pos,
                              sampling=x.req.sampling if x.sample else None) for x in planned]
            result = await group.step(self._step_ids, seqs)
        except RankError as exc:
            self._on_rank_error(group, planned, exc)
            return
        except GroupFailed as exc:
            self.detach(f"model {self.model_id!r} failed: {exc}", "model_unavailable")
            return
        self.steps += 1
        for i, x in enumerate(planned):
            x.req.computed += len(x.tokens)
            if x.sample and not x.req.finished:
                lp = result.logprobs[i] if result.logprobs else None
                self._on_token(x.req, result.tokens[i], lp)

    def _on_rank_error(self, group: RankGroup, planned: list[Planned], exc: RankError) -> None:
        if group.world > 1:
            # Another rank may be waiting in a collective this one will never join.
            group.fail(str(exc))
            self.detach(f"model {self.model_id!r} failed: {exc}")
            return
        log.warning("%s: step failed (%s); failing its %d request(s)", self.model_id, exc, len(planned))
        for x in planned:
            self._fail(x.req, f"step failed: {exc.kind}: {exc.message}", exc.kind)

    def _on_token(self, req: GenRequest, token: int, logprobs: list[tuple[int, float]] | None) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.output.append(token)
        self.tokens_generated += 1
        if token in req.stop_token_ids:
            self._emit(req, req.stop_matcher.flush(), [token], logprobs)
            self._finish(req, "stop")
            return
        text, hit = req.stop_matcher.push(req.detokenizer.push(token))
        if hit:
            self._emit(req, text, [token], logprobs)
            self._finish(req, "stop")
            return
        if len(req.output) >= req.max_tokens or len(req.prompt) + len(req.output) >= self.max_len:
            text += req.stop_matcher.push(req.detokenizer.flush())[0] + req.stop_matcher.flush()
            self._emit(req, text, [token], logprobs)
            self._finish(req, "length")
            return
        self._emit(req, text, [token], logprobs)

    def _emit(self, req: GenRequest, text: str, ids: list[int], logprobs) -> None:
        req.events.put_nowait(TokenEvent(text, ids, [logprobs] if logprobs else None))

    def _finish(self, req: GenRequest, reason: str, error: str | None = None, kind: str | None = None) -> None:
        if req.finished:
            return
        req.finished = True
        if req.slot >= 0 and req in self.sched.running:
            self._to_free.append(req.slot)
        self.sched.release(req)
        event = FinishEvent(reason, len(req.prompt), len(req.output), error, kind)
        req.events.put_nowait(event)
        if not req.admitted.done():
            req.admitted.set_result(True)
        if self.on_finish is not None:
            self.on_finish(req, event)
        log.info("%s %s finished: %s, %d prompt + %d completion tokens%s", self.model_id, req.request_id,
                 reason, len(req.prompt), len(req.output), f" ({error})" if error else "")

    def _fail(self, req: GenRequest, message: str, kind: str) -> None:
        if not req.admitted.done():
            req.admitted.set_exception(ApiError(503, "model_unavailable", message, retry_after=5))
            req.finished = True
            self.sched.release(req)
            return
        self._finish(req, "abort", message, kind)
