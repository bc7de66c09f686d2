"""The Registry actor: models by id, their load/unload, status and automatic recovery.

A model's status moves ``loading -> loaded``; when its rank group fails it becomes
``poisoned`` (in-flight requests end at once), then ``recovering`` while the group is killed,
respawned and reloaded, then ``loaded`` again (or ``failed`` after the configured attempts).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import zmq.asyncio

import protocol as p
from protocol.sockets import runtime_dir

from . import heap
from .config import Config, ModelEntry
from .devices import choose_devices, default_dtype
from .engine.client import OnFinish
from .engine.engine import Engine
from .engine.shape import Sizing, engine_sizes
from .engine.step_budget import StepBudget
from .model_names import clash, served
from .kernels import isa
from .errors import ApiError, LoadError
from .loader.spec import load_spec, model_id_for
from .loader.template_worker import TemplateRenderer
from .models import families
from .models.sharding import ShardingError

from .leader_sockets import CurveGate, TapMirror
from .model_handle import ModelHandle
from .prefix_tiers import leave_s, shard_fields, tiers_loaded
from .rankgroup import GroupFailed, RankError, RankGroup
from .speculation import draft_policy, speculation_refused

QUANT_GROUP = 32  # models.quant.GROUP, without importing torch in the leader

log = logging.getLogger("neuron.registry")


class Registry:
    def __init__(self, cfg: Config, on_finish: OnFinish | None = None,
                 templates: TemplateRenderer | None = None) -> None:
        self.cfg = cfg
        self.on_finish = on_finish
        self.templates = templates
        self.ctx = zmq.asyncio.Context()
        self.runtime = runtime_dir(cfg.runtime.dir or None)
        self.tap = TapMirror(self.ctx, cfg.debug.tap) if cfg.debug.tap else None
        clustered = cfg.cluster.nnodes > 1
        self.curve = CurveGate(self.ctx) if cfg.runtime.transport == "tcp" or clustered else None
        self.cluster = None
        if clustered:
            from .cluster.head import ClusterHead
            from .cluster.keys import read_key

            self.group_key = read_key(cfg.cluster.group_key, head=True)
            self.curve.allow(self.group_key.client_public)
            self.cluster = ClusterHead(cfg.cluster, self.group_key, self.ctx, cfg.timeouts.heartbeat_timeout_s)
        self.models: dict[str, ModelHandle] = {}
        self._ops: dict[str, asyncio.Task] = {}  # the lifecycle operation in progress, per model id
        self.closing = False
        self.draining = False

    def get(self, model_id: str) -> ModelHandle:
        return served(self.models, model_id)

    async def refresh(self) -> None:
        """Nothing to fetch: the models are this process's own (an API process's mirror is not)."""

    async def inject_fault(self, model_id: str, rank: int, kind: str) -> str:
        """Test hook: ``rank`` fails its next step as ``kind`` says; what the rank answered."""
        handle = self.get(model_id)
        group = handle.group
        if group is None or not 0 <= rank < group.world:
            raise ApiError(400, "invalid_request", f"model {model_id!r} has no rank {rank}", param="rank")
        reply = await group.request(rank, lambda i: p.InjectFault(id=i, epoch=group.epoch, kind=kind), 10.0)
        return type(reply).__name__

    # ----------------------------------------------------------------------------- lifecycle
    # One operation at a time per model id (``_ops``): a load, an unload or a recovery. A load
    # joins a load of the same id in progress, and is refused (409) while the id unloads; an
    # unload cancels a load or a recovery in progress (whose group is then killed) and joins an
    # unload in progress. So no path leaves a rank without a model, or removes another's model.
    def _op(self, model_id: str, kind: str, coro) -> asyncio.Task:
        task = asyncio.create_task(coro, name=f"{kind}-{model_id}")
        task.kind = kind  # type: ignore[attr-defined]
        self._ops[model_id] = task

        def done(_: asyncio.Task) -> None:
            if self._ops.get(model_id) is task:
                del self._ops[model_id]
        task.add_done_callback(done)
        return task

    async def load(self, entry: ModelEntry) -> ModelHandle:
        """Load a model; concurrent loads of the same id share one load."""
        if self.closing:
            raise ApiError(503, "shutting_down", "the server is shutting down")
        model_id = entry.id or model_id_for(entry.model)
        if self.cluster is not None and entry.model != self.cfg.models[0].model:
            raise ApiError(409, "cluster_model", f"this group of {self.cfg.cluster.nnodes} nodes serves "
                           f"{self.cfg.models[0].model!r} only; start the group with the model you want", param="model")
        op = self._ops.get(model_id)
        if op is not None and op.kind == "unload":  # type: ignore[attr-defined]
            raise ApiError(409, "model_unloading", f"model {model_id!r} is being unloaded; load it again after",
                           param="model", retry_after=1)
        existing = self.models.get(model_id)
        if existing is not None and existing.status in ("loaded", "poisoned", "recovering"):
            return existing
        taken = clash(model_id, entry.aliases, self.models)
        if taken is not None:
            raise ApiError(409, "model_name_taken", f"{taken!r} already names another loaded model", param="aliases")
        if op is None or op.kind != "load":  # type: ignore[attr-defined]
            op = self._op(model_id, "load", self._load(model_id, entry))
        try:
            return await asyncio.shield(op)
        except asyncio.CancelledError:
            if op.cancelled():  # an unload (or the shutdown) cancelled the load, not our caller
                raise ApiError(409, "load_cancelled", f"model {model_id!r} was unloaded while it loaded",
                               param="model") from None
            raise

    async def _load(self, model_id: str, entry: ModelEntry) -> ModelHandle:
        t0 = time.monotonic()
        try:
            spec = await asyncio.to_thread(load_spec, entry.model, model_id=model_id,
                                           hf_cache=self.cfg.runtime.hf_cache or None, roots=self.cfg.server.model_roots)
            if self.templates is not None:
                await asyncio.to_thread(self.templates.check_model, spec)
        except LoadError:
            await asyncio.to_thread(heap.trim)  # what reading the refused files took
            raise
        nodes, world = self.cfg.cluster.nnodes, entry.tensor_parallel * entry.pipeline_parallel
        try:
            if world % nodes:
                raise ValueError(f"{world} ranks (tensor_parallel x pipeline_parallel) do not split over {nodes} nodes")
            devices = choose_devices(entry.device, world // nodes, entry.devices)
            # NEURON_CPU_ISA or NEURON_CPU_ACTIVATIONS that cannot run here: refused by name
            how = isa.activations(isa.choose()) if devices[0] == "cpu" else ""
        except ValueError as exc:
            raise LoadError(str(exc)) from None
        max_len = min(entry.max_model_len, spec.context_length)
        gpu = devices[0].startswith("cuda")
        budget, chunk, chunk_decoding = engine_sizes(self.cfg.engine, entry, gpu, spec.config.num_experts > 0)
        in_flight = self.cfg.engine.steps_in_flight or (3 if gpu else 2)
        handle = ModelHandle(model_id, entry, spec, devices, default_dtype(devices, entry.dtype), max_len,
                             Engine(model_id, self.cfg.engine, Sizing(
                                 entry.max_slots, max_len, budget, chunk, chunk_decoding, in_flight,
                                 # the K/V of a prefix depends on the weights and how they are computed
                                 f"{model_id}|{spec.files.paths}|{entry.dtype}|{entry.tensor_parallel}|{entry.quantize}"
                                 f"|{entry.state_dtype}|{how}" if entry.prefix_caching else None,
                                 entry.state_snapshot_interval, 4 * spec.config.hidden_size,
                                 entry.pipeline_parallel,
                                 draft_policy(model_id, entry, gpu, spec.config.vocab_size))))
        family = families.family(spec.config.family)
        try:  # packed weights split their input columns on whole quant groups
            family.check_split(spec.config, entry.tensor_parallel, QUANT_GROUP if handle.packed else 1)
            if entry.pipeline_parallel > 1 and not getattr(family, "PIPELINE", False):
                raise ShardingError(f"the {spec.config.family} family has no pipeline-parallel split yet")
            if entry.pipeline_parallel > spec.config.num_layers:
                raise ShardingError(f"{entry.pipeline_parallel} pipeline stages for {spec.config.num_layers} layers")
        except ShardingError as exc:
            raise LoadError(f"model {model_id!r} cannot be split: {exc}") from None
        if entry.speculative.method:
            why = speculation_refused(entry, spec)
            if why:
                raise LoadError(f"model {model_id!r}: speculative decoding ({entry.speculative.method}) {why}")
        handle.client.on_finish = self.on_finish
        self.models[model_id] = handle
        try:
            handle.group = await self._start_group(handle)
        except (GroupFailed, RankError) as exc:
            self._forget(handle)
            raise ApiError(500, "load_failed", f"model {model_id!r} failed to load: {exc}") from None
        except BaseException:
            self._forget(handle)
            raise
        handle.status = "loaded"
        handle.load_seconds = time.monotonic() - t0
        log.info("%s loaded in %.2fs on %s (%s), weights %s, shard bytes %s (%s)%s", model_id, handle.load_seconds,
                 devices, handle.dtype, handle.weight_format, handle.shard_bytes, handle.packing,
                 f", CPU kernels {handle.cpu_isa}" if handle.cpu_isa else "")
        return handle

    async def _start_group(self, handle: ModelHandle) -> RankGroup:
        remote = None
        if self.cluster is not None:
            from .cluster.fingerprint import model_fingerprint
            from .cluster.head import Remote

            fingerprint = await asyncio.to_thread(model_fingerprint, handle.spec)
            remote = Remote(self.cluster, self.group_key, handle.entry.model, fingerprint,
                            handle.entry.tensor_parallel * handle.entry.pipeline_parallel)
        group = RankGroup(model_id=handle.id, devices=handle.devices, timeouts=self.cfg.timeouts,
                          runtime_dir=self.runtime, ctx=self.ctx, tap=self.tap,
                          allow_faults=self.cfg.debug.fault_injection, on_failure=self._on_group_failure,
                          curve=self.curve, remote=remote, pipeline=handle.entry.pipeline_parallel)
        spec, entry, z = handle.spec, handle.entry, handle.engine.sizing
        handle.loading = group
        progress = asyncio.create_task(log_progress(handle, group))
        gpu = handle.devices[0].startswith("cuda")
        # On the CPU the KV cache holds every slot at full length unless told otherwise; on a GPU
        # it takes what the memory left after the weights allows.
        kv_tokens = entry.kv_cache_tokens or (0 if gpu else entry.max_slots * z.max_len)
        try:
            await group.start()
            oks = await group.load(lambda i: p.LoadShard(
                id=i, epoch=group.epoch, model=handle.id, format=spec.files.format,
                paths=[str(x) for x in spec.files.paths], config=spec.config, dtype=handle.dtype,
                max_slots=entry.max_slots, max_len=z.max_len, block_size=entry.block_size, kv_tokens=kv_tokens,
                memory_fraction=entry.gpu_memory_utilization, max_step_tokens=z.max_batch_tokens + entry.max_slots,
                cuda_graphs=entry.cuda_graphs, quant=entry.quantize or None, state_dtype=entry.state_dtype,
                state_snapshots=entry.state_snapshots if z.cache_key is not None else 0,
                checkpoint_quant=spec.checkpoint_quant, pipeline=entry.pipeline_parallel,
                draft_rows=z.speculative.rows if z.speculative else 0, mtp=entry.speculative.method == "mtp",
                **shard_fields(self.cfg, handle, group.world)))
        except BaseException:
            await group.close_after_failure()
            raise
        finally:
            progress.cancel()
            handle.loading = None
        handle.shard_bytes = [oks[r].bytes for r in range(group.world)]
        handle.packing = oks[0].packing
        handle.cpu_isa = oks[0].cpu_isa or None
        handle.kv_bytes = [oks[r].kv_bytes for r in range(group.world)]
        handle.state_bytes = [oks[r].state_bytes for r in range(group.world)]
        handle.graphs = oks[0].graphs
        auto = gpu and not self.cfg.engine.prefill_chunk_decoding and oks[0].prefill_ms and oks[0].decode_ms
        z.step_budget = StepBudget(oks[0].decode_ms, oks[0].prefill_ms, self.cfg.engine.decode_slowdown) if auto else None
        if z.speculative is not None and gpu and oks[0].kv_blocks and oks[0].bytes:
            per_token = oks[0].kv_bytes / (oks[0].kv_blocks * entry.block_size)
            z.speculative.context_cost = per_token / oks[0].bytes
        blocks = min(ok.kv_blocks for ok in oks.values())
        if blocks * entry.block_size < handle.max_len:
            log.warning("%s: the KV cache holds %d tokens; max_model_len lowered from %d", handle.id,
                        blocks * entry.block_size, handle.max_len)
            handle.max_len = blocks * entry.block_size
            handle.engine.max_len = handle.max_len
        state_slots = min(ok.state_slots for ok in oks.values())
        snapshots = min(ok.state_snapshots for ok in oks.values())
        if state_slots and not snapshots and handle.engine.sizing.cache_key is not None:
            log.info("%s: its layers keep per-sequence state and no slot is left for snapshots; prefix caching is "
                     "off", handle.id)
        host, per_step, tiers = tiers_loaded(self.cfg, handle, oks, state_slots)
        handle.engine.attach(group, blocks, entry.block_size, state_slots, snapshots, host, per_step, tiers)
        return group

    def _forget(self, handle: ModelHandle) -> None:
        if self.models.get(handle.id) is handle:
            del self.models[handle.id]

    # ----------------------------------------------------------------------------- recovery
    def _on_group_failure(self, group: RankGroup, reason: str) -> None:
        handle = next((h for h in self.models.values() if h.group is group), None)
        if handle is None or self.closing or handle.status not in ("loaded",):
            return
        if self.draining:
            log.warning("%s: rank group failed while the server drains (%s); not respawned", handle.id, reason)
            handle.engine.detach(f"model {handle.id!r} failed: {reason}")
            return
        handle.status = "poisoned"
        handle.error = reason
        handle.engine.detach(f"model {handle.id!r} failed: {reason}")
        if handle.id not in self._ops:  # an unload in progress takes the model down anyway
            self._op(handle.id, "recover", self._recover(handle, group))

    async def _recover(self, handle: ModelHandle, old: RankGroup) -> None:
        await old.close_after_failure()
        handle.status = "recovering"
        for attempt in range(1, self.cfg.timeouts.recovery_attempts + 1):
            if self.closing or self.models.get(handle.id) is not handle:
                return
            t0 = time.monotonic()
            try:
                handle.group = await self._start_group(handle)
            except (GroupFailed, RankError) as exc:
                log.error("%s: recovery attempt %d failed: %s", handle.id, attempt, exc)
                await asyncio.sleep(min(2.0 * attempt, 10.0))
                continue
            handle.recoveries += 1
            handle.status = "loaded"
            log.info("%s recovered in %.2fs (attempt %d)", handle.id, time.monotonic() - t0, attempt)
            return
        handle.status = "failed"
        handle.group = None

    # ----------------------------------------------------------------------------- unload
    async def unload(self, model_id: str, drain_s: float = 30.0) -> str:
        """Unload a model: what it did, "unloaded" or "load_cancelled" (it was still loading)."""
        op = self._ops.get(model_id)
        if op is not None and op.kind == "unload":  # type: ignore[attr-defined]
            return await asyncio.shield(op)
        if op is None and model_id not in self.models:
            raise ApiError(404, "model_not_found", f"model {model_id!r} is not loaded", param="model")
        return await asyncio.shield(self._op(model_id, "unload", self._unload(model_id, op, drain_s)))

    async def _unload(self, model_id: str, before: asyncio.Task | None, drain_s: float) -> str:
        cancelled_load = False
        if before is not None:  # a load or a recovery: stopped, its group killed on the way out
            cancelled_load = before.kind == "load"  # type: ignore[attr-defined]
            before.cancel()
            await asyncio.wait({before})
        handle = self.models.get(model_id)
        if handle is None:
            log.info("%s: load cancelled by an unload", model_id)
            return "load_cancelled"
        serving = handle.status == "loaded"
        handle.status = "unloading"
        handle.engine.accepting = False
        if serving and not await handle.engine.wait_idle(drain_s):
            log.warning("%s: requests still running after %.0fs; aborting them", model_id, drain_s)
        handle.engine.detach(f"model {model_id!r} was unloaded", "unloaded")
        await handle.engine.stop()
        self._forget(handle)
        if handle.group is not None:
            await handle.group.shutdown(timeout=leave_s(handle.host_bytes, 10.0))
        log.info("%s unloaded", model_id)
        return "load_cancelled" if cancelled_load else "unloaded"

    def stop_admission(self) -> None:
        self.draining = True  # a group that fails from now on is not respawned
        for handle in self.models.values():
            handle.engine.accepting = False

    def abort_all(self, reason: str) -> None:
        """End every request of every model now: streams with an error event, the queued with 503."""
        for handle in self.models.values():
            handle.engine.detach(reason, "shutting_down")

    async def drain(self, timeout: float) -> bool:
        results = await asyncio.gather(*(h.engine.wait_idle(timeout) for h in self.models.values()))
        return all(results)

    async def shutdown(self) -> None:
        """Stop everything: loads, recoveries and unloads in progress are cancelled (their groups
        killed), then every model's requests end and its ranks are asked to leave, or killed."""
        self.closing = True
        ops = list(self._ops.values())
        for task in ops:
            task.cancel()
        if ops:
            await asyncio.wait(ops, timeout=10.0)
        for model_id in list(self.models):
            handle = self.models.pop(model_id)
            handle.engine.detach("the server is shutting down", "shutting_down")
            await handle.engine.stop()
            if handle.group is not None:
                await handle.group.shutdown(timeout=leave_s(handle.host_bytes, 5.0))
        self._close()

    def kill_all(self) -> None:
        """Kill every rank process at once (the last resort of a shutdown that did not end)."""
        for handle in list(self.models.values()):
            for group in (handle.group, handle.loading):
                for pid in group.pids if group is not None else ():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass

    def _close(self) -> None:
        """The leader's sockets and its private directory, once every group is gone."""
        if self.tap is not None:
            self.tap.close()
        if self.cluster is not None:
            self.cluster.close()
        if self.curve is not None:
            self.curve.stop()
        self.ctx.destroy(linger=0)
        try:
            self.runtime.rmdir()
        except OSError:
            pass


async def log_progress(handle: ModelHandle, group: RankGroup, every_s: float = 5.0) -> None:
    """A log line every ``every_s`` while a model's weights are read."""
    while True:
        await asyncio.sleep(every_s)
        done = sum(group.loaded_bytes.values())
        if done:
            log.info("%s: loading, %.2f GB of weights read", handle.id, done / 1e9)
