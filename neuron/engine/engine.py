"""The Engine actor of one model: admission queue, the scheduler loop that turns requests into
steps for the RankGroup, and the per-request event streams."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import protocol as p
from protocol.engine_client import EngineStats, FinishEvent
from neuron.config import EngineConfig
from neuron.errors import ApiError
from neuron.rankgroup import GroupFailed, RankError, RankGroup

from .image_cache import ImageCache
from .late_masks import LateMasks
from .request import GenRequest
from .planned import Planned
from .scheduler import Scheduler
from .shape import Sizing

log = logging.getLogger("neuron.engine")


class Engine:
    def __init__(self, model_id: str, cfg: EngineConfig, sizing: Sizing) -> None:
        self.model_id = model_id
        self.cfg = cfg
        self.sizing = sizing
        self.max_len = sizing.max_len
        self.sched = self._scheduler(1, 16, 0)
        self.images = ImageCache(sizing.image_token_bytes, int(cfg.image_embedding_cache_mb * 2**20))
        self._snapshots = 0
        self._cache_counts = (0, 0)  # prefix-cache queries and hits of the caches before this one
        self._host_counts = (0,) * 9  # the host and disk tiers' counts (HostTier.counts) of those before this one
        # Steps in flight: the next is sent before the last one's reply is in (overlapped steps).
        self.depth = max(sizing.steps_in_flight, sizing.pipeline)
        self._group = 0  # the micro-batch group planned next (pipeline stages)
        self.inflight: deque[tuple[list[Planned], asyncio.Future]] = deque()
        self.group: RankGroup | None = None
        self.accepting = True
        self._wake, self._idle = asyncio.Event(), asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self._step_ids = 0
        self.steps = self.tokens_generated = 0
        self.leader_s = 0.0
        self.rank_host_ms = 0.0  # rank 0's host time preparing and launching steps, summed
        self.mask_wait_ms = 0.0  # ... of it, waiting for late masks
        self.device_idle_ms = 0.0  # the device's idle gaps between steps, summed
        self.move_ms = [0.0, 0.0]  # rank 0's device time moving blocks to the host tier and back
        self._last_result: float | None = None
        self.step_ms = 0.0
        self.spec = [0, 0, 0]  # speculative decoding: decodes with drafts, drafts, drafts accepted
        self.late = LateMasks()

    def _scheduler(self, num_blocks: int, block_size: int, state_slots: int, snapshots: int = 0) -> Scheduler:
        z = self.sizing
        sched = Scheduler(z.max_slots, self.max_len, num_blocks, block_size, z.max_batch_tokens, z.prefill_chunk,
                          z.prefill_chunk_decoding, z.cache_key.encode() if z.cache_key else None, state_slots,
                          snapshots, z.snapshot_interval, z.speculative, z.step_budget)
        sched.late_masks = z.pipeline == 1 and z.steps_in_flight > 1
        return sched

    def _host_tallies(self) -> tuple[int, ...]:
        h = self.sched.host
        return tuple(a + b for a, b in zip(self._host_counts, h.counts())) if h else self._host_counts

    # ----------------------------------------------------------------------------- control
    def attach(self, group: RankGroup, num_blocks: int, block_size: int, state_slots: int = 0,
               snapshots: int = 0, host_blocks: int = 0, restore_per_step: int = 0, tiers: dict | None = None) -> None:
        """Serve on ``group``, whose ranks hold ``num_blocks`` KV blocks and ``state_slots``
        per-sequence state slots each (``snapshots`` of them beyond one per slot, for the prefix
        cache's state snapshots), ``host_blocks`` slots of a host tier, of which a step beside
        decodes restores ``restore_per_step`` at most, and ``tiers`` the rest of ``use_host``'s fields
        (a disk tier, state snapshots' pieces)."""
        self.group = group
        old = self.sched.blocks  # a fresh cache (the ranks' is new); the counters carry on
        self._cache_counts = (self._cache_counts[0] + old.queries, self._cache_counts[1] + old.hits)
        self._host_counts = self._host_tallies()
        self.sched = self._scheduler(num_blocks, block_size, state_slots, snapshots)
        self.sched.use_host(host_blocks, restore_per_step, **(tiers or {}))
        self.images.clear()  # the new ranks keep no image embeddings
        self._snapshots = snapshots
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"engine-{self.model_id}")
        self._wake.set()

    def detach(self, reason: str, kind: str = "model_unavailable") -> None:
        """The group is gone: every request in flight or waiting ends now, with the reason."""
        self.group = None
        for req in list(self.sched.running) + list(self.sched.waiting):
            self._fail(req, reason, kind)
        for _, future in self.inflight:
            # A step that failed with the group is no news: its exception is retrieved, even when
            # the cancel comes too late to stop the wait raising it.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            future.cancel()
        self.inflight.clear()
        self.late.clear()
        self._wake.set()  # the loop notices it is idle

    async def stop(self, timeout: float = 5.0) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=timeout)
            if not self._task.done():
                log.error("%s: the scheduler loop did not stop within %.0fs", self.model_id, timeout)

    def submit(self, req: GenRequest) -> None:
        if not self.accepting:
            raise ApiError(503, "shutting_down", "the server is shutting down")
        if self.group is None:
            raise ApiError(503, "model_unavailable", f"model {self.model_id!r} is not ready", retry_after=5)
        if len(self.sched.waiting) >= self.cfg.queue_size:
            raise ApiError(429, "rate_limit_exceeded",
                           f"the queue of model {self.model_id!r} is full ({self.cfg.queue_size} waiting)",
                           retry_after=max(1, len(self.sched.running)))
        if req.max_waiting and self._waiting_beyond_room(req) >= req.max_waiting:
            raise ApiError(429, "rate_limit_exceeded",
                           f"key {req.principal!r} has {req.max_waiting} requests waiting for model "
                           f"{self.model_id!r}, its max_waiting", retry_after=max(1, len(self.sched.running)))
        self.sched.waiting.append(req)
        self._idle.clear()
        self._wake.set()

    def _waiting_beyond_room(self, req: GenRequest) -> int:
        """The requests of ``req``'s principal that wait for more than the next admission: a burst
        that free slots (within its cap) will take is not a queue."""
        room = len(self.sched.free_slots)
        if req.max_running:
            running = sum(1 for r in self.sched.running if r.principal == req.principal)
            room = min(room, max(0, req.max_running - running))
        return self.sched.waiting.waiting_of(req.principal) - room

    def abort(self, req: GenRequest, reason: str = "abort") -> None:
        if not req.finished:
            req.abort(reason)
            self.late.send(self.group, [req])  # a step in flight may wait for its mask
            self._wake.set()

    def masks_arrived(self, reqs: list[GenRequest]) -> None:
        """Constraints' masks came from their API process: to the steps waiting for them, or for
        the sequences' next plans."""
        self.late.send(self.group, reqs)
        self._wake.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def stats(self) -> EngineStats:
        s, (host_hits, host_offloaded, host_restored, *disk, states_out, states_in, skipped) = self.sched, self._host_tallies()
        return EngineStats(len(s.running), len(s.waiting), s.max_slots - len(s.free_slots), s.max_slots,
                           self.steps, self.tokens_generated, kv_usage=s.blocks.used / s.blocks.num_blocks,
                           kv_blocks=s.blocks.num_blocks, preemptions=s.preemptions,
                           state_slots=s.states.num_slots, state_slots_used=s.states.used,
                           state_snapshots=self._snapshots, state_snapshots_used=s.states.snapshots,
                           state_restores=s.states.restored,
                           prefix_cache_queries=self._cache_counts[0] + s.blocks.queries,
                           prefix_cache_hits=self._cache_counts[1] + s.blocks.hits,
                           host_blocks=s.host.slots if s.host else 0, host_used=s.host.used if s.host else 0,
                           host_hits=host_hits, host_offloaded=host_offloaded, host_restored=host_restored,
                           host_offload_s=self.move_ms[0] / 1e3, host_restore_s=self.move_ms[1] / 1e3,
                           host_state_offloaded=states_out, host_state_restored=states_in,
                           disk_blocks=s.host.disk_blocks if s.host else 0, disk_used=len(s.host.disk or ()) if s.host else 0,
                           disk_hits=disk[0], disk_written=disk[1], disk_read=disk[2], disk_skipped=skipped,
                           leader_ms_per_step=1e3 * self.leader_s / max(1, self.steps), step_ms=self.step_ms,
                           rank_host_ms_per_step=self.rank_host_ms / max(1, self.steps),
                           rank_mask_wait_ms_per_step=self.mask_wait_ms / max(1, self.steps),
                           image_encodes=self.images.encodes, image_reuses=self.images.reuses,
                           spec_drafts=self.spec[0], spec_draft_tokens=self.spec[1], spec_accepted_tokens=self.spec[2],
                           device_idle_ms_per_step=self.device_idle_ms / max(1, self.steps))

    # ----------------------------------------------------------------------------- the loop
    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.group is not None and (not self.sched.idle or self.inflight or self.sched.disk_waits()):
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

    def _next_plan(self) -> list:
        """The next step's plan: every running sequence, or with pipeline stages the next group
        of them that has anything to run."""
        groups = self.sizing.pipeline
        if groups == 1:
            return self.sched.schedule()
        for i in range(groups):
            g = (self._group + i) % groups
            plan = self.sched.schedule(g, groups)
            if plan:
                self._group = (g + 1) % groups
                return plan
        return []

    async def _iterate(self, group: RankGroup) -> None:
        t0 = time.perf_counter()
        self._housekeeping()
        try:
            while len(self.inflight) < self.depth:
                plan = self._next_plan()
                if not plan and (self.inflight or not self.sched.disk_waits()):  # else: the disk tier's moves
                    break
                self._step_ids += 1
                seqs = [p.StepSeq(slot=x.req.slot, tokens=x.tokens, start_pos=x.start_pos, sample=x.sample,
                                  blocks=x.blocks, block_start=x.block_start,
                                  sampling=x.req.sampling if x.start else None,
                                  **self.late.fields(x.req, x.sample, self._step_ids),
                                  context=_context(x), state=x.req.states[0] if x.req.states else -1,
                                  state_from=x.state_from, snapshots=self.sched.step_snapshots(x),
                                  kv_from=x.kv_from,
                                  images=self.images.step_images(x.req, x.start_pos)
                                  if x.start and x.req.images else [], drafts=x.drafts, propose=x.propose)
                        for x in plan]
                waiter = await group.send_step(self._step_ids, seqs, self.images.take_forget(),
                                                    self.sched.take_moves(plan))
                self.inflight.append((plan, asyncio.ensure_future(waiter())))
        except GroupFailed as exc:
            self.detach(f"model {self.model_id!r} failed: {exc}", "model_unavailable")
            return
        finally:
            self.leader_s += time.perf_counter() - t0
        if not self.inflight:
            # Nothing can start yet (blocks, a token still in flight, a constraint's next mask
            # from its API process): wait for news, a little.
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), 0.005)
            except TimeoutError:
                pass
            return
        plan, future = self.inflight[0]
        try:
            result = await future
        except RankError as exc:
            self.inflight.popleft()
            self._on_rank_error(group, plan, exc)
            return
        except GroupFailed as exc:
            if self.group is group:
                self.detach(f"model {self.model_id!r} failed: {exc}", "model_unavailable")
            return
        except asyncio.CancelledError:
            task = asyncio.current_task()
            stopping = task is not None and task.cancelling() > 0
            if not stopping and future.cancelled() and self.group is not group:  # detached while the step was out
                return
            raise
        self.inflight.popleft()
        t1 = time.perf_counter()
        if self._last_result is not None:
            self.step_ms = 0.9 * self.step_ms + 0.1 * (t1 - self._last_result) * 1e3 if self.step_ms else \
                (t1 - self._last_result) * 1e3
        self._last_result = t1
        self.steps += 1
        drafted = result.drafted or []
        for i, x in enumerate(plan):
            if x.drafts:
                accepted = min(len(drafted[i]), x.drafts) if i < len(drafted) else 0
                self.sched.drafts_checked(x, accepted)
                self.spec = [self.spec[0] + 1, self.spec[1] + x.drafts, self.spec[2] + accepted]
        self.sched.completed(plan, result.disk_fetched, result.disk_lost)
        self.sched.step_took(plan, result.timings.forward_ms / 1e3)
        self.rank_host_ms += result.timings.host_ms
        self.mask_wait_ms += result.timings.mask_wait_ms
        self.device_idle_ms += result.timings.idle_ms
        self.move_ms[0] += result.timings.offload_ms
        self.move_ms[1] += result.timings.restore_ms
        # Constrained sequences' tokens first, and the masks that depend on them out to the step
        # that waits for them; the output stage (text, stop strings, events) after.
        taken = [x.sample and x.req.constraint is not None and not x.drafts and not x.req.finished for x in plan]
        for i, x in enumerate(plan):
            if taken[i]:
                self._take(x.req, result.tokens[i])
        self.late.send(group)
        for i, x in enumerate(plan):
            if x.sample:
                x.req.pending -= 1
                for token in drafted[i] if i < len(drafted) else []:  # accepted drafts come first
                    if not x.req.finished:
                        self._take(x.req, token)
                        self._emit(x.req, token, None)
                if not x.req.finished:
                    lp = result.logprobs[i] if result.logprobs else None
                    if not taken[i]:
                        self._take(x.req, result.tokens[i])
                    self._emit(x.req, result.tokens[i], lp)
                if result.proposals and result.proposals[i] and x.req.spec is not None:
                    x.req.spec.index.offer(len(x.req.prompt) + len(x.req.output), result.proposals[i])
        if not self.inflight:
            self._last_result = None  # the pipeline ran dry: the next gap is not a step
        self.leader_s += time.perf_counter() - t1
        # A step's result is often in before it is awaited (steps overlap): let the streams write
        # this step's tokens before the next one, or they would leave in bursts.
        await asyncio.sleep(0)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        for req in list(self.sched.running):
            if req.cancelled:
                self._finish(req, req.end_reason)
        for req in list(self.sched.waiting):
            if req.cancelled:
                if req.admitted.done():  # preempted: it had started
                    self._finish(req, req.end_reason)
                else:
                    self.sched.release(req)
            elif not req.admitted.done() and now - req.arrival > self.cfg.max_queue_wait_s:
                self.sched.release(req)
                req.finished = True
                req.admitted.set_exception(ApiError(
                    429, "rate_limit_exceeded", f"waited over {self.cfg.max_queue_wait_s:.0f}s for a free slot",
                    retry_after=5))
        for req in self.sched.admit():
            if not req.admitted.done():
                req.admitted.set_result(True)

    def _on_rank_error(self, group: RankGroup, planned: list[Planned], exc: RankError) -> None:
        if group.world > 1:
            # Another rank may be waiting in a collective this one will never join.
            group.fail(str(exc))
            self.detach(f"model {self.model_id!r} failed: {exc}")
            return
        log.warning("%s: step failed (%s); failing its %d request(s)", self.model_id, exc, len(planned))
        self.sched.abandon(planned)
        self.images.drop_all()
        for x in planned:
            if x.sample:
                x.req.pending -= 1
            self._fail(x.req, f"step failed: {exc.kind}: {exc.message}", exc.kind)

    def _take(self, req: GenRequest, token: int) -> None:
        req.output.append(token)
        self.tokens_generated += 1
        if req.constraint is not None:
            req.constraint.accept(token)

    def _emit(self, req: GenRequest, token: int, logprobs: list[tuple[int, float]] | None) -> None:
        """The output stage of a token just taken (text, stop strings, events); it may end the
        request."""
        if token in req.stop_token_ids:
            req.sink.token(token, logprobs, 2)
            self._finish(req, "stop")
            return
        last = len(req.output) >= req.max_tokens or len(req.prompt) + len(req.output) >= self.max_len
        if req.sink.token(token, logprobs, 1 if last else 0):  # a stop string ended the text
            self._finish(req, "stop")
        elif last:
            self._finish(req, "length")

    def _finish(self, req: GenRequest, reason: str, error: str | None = None, kind: str | None = None) -> None:
        if req.finished:
            return
        req.finished = True
        self.late.send(self.group, [req])
        self.sched.release(req, keep=error is None)
        event = FinishEvent(reason, len(req.prompt), len(req.output), error, kind, req.cached_tokens,
                            req.host_tokens, req.disk_tokens, req.preempted)
        req.sink.finish(event)
        if not req.admitted.done():
            req.admitted.set_result(True)
        log.info("%s %s finished: %s, %d prompt + %d completion tokens%s%s", self.model_id, req.request_id,
                 reason, len(req.prompt), len(req.output), f", preempted {req.preempted}x" if req.preempted else "",
                 f" ({error})" if error else "")

    def _fail(self, req: GenRequest, message: str, kind: str) -> None:
        if not req.admitted.done():
            code = "shutting_down" if kind == "shutting_down" else "model_unavailable"
            req.admitted.set_exception(ApiError(503, code, message, retry_after=5))
            req.finished = True
            self.sched.release(req)
            return
        self._finish(req, "abort", message, kind)


def _context(x: Planned) -> list[int]:
    """The tokens before a sequence's first step that the rank's sampler must know: only a
    penalised sequence starting past position 0 (its prefix came from the cache) needs them."""
    p = x.req.sampling
    if not x.start or not x.start_pos or (p.repetition_penalty == 1.0 and not p.frequency_penalty
                                          and not p.presence_penalty):
        return []
    return (x.req.prompt + x.req.output)[: x.start_pos]
