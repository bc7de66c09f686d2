"""Everything a rank does with torch. Runs only on the rank's one device executor thread."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import protocol as p
from neuron.models import families
from neuron.models.interface import Model
from neuron.models.tp_linear import describe_packing, packed_kernel_for
from neuron.models.quant import GROUP, SCHEMES
from neuron.models.sharding import ShardingError
from neuron.models.stages import Stage, stage_layers
from neuron.runner.late_masks import LateMasks
from neuron.runner.runner import ModelRunner, PendingStep, RunnerConfig, StepRejected
from neuron.runner import step_times

from .deferred import Deferred

from .telemetry import TelemetrySampler

log = logging.getLogger("neuron.rank")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RankFailure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Counted:
    """A weight source that adds up the bytes it hands out (the load's progress, in heartbeats)."""

    def __init__(self, src, worker: "DeviceWorker") -> None:
        self.src, self.worker = src, worker

    def get(self, name: str, **kwargs) -> torch.Tensor:
        t = self.src.get(name, **kwargs)
        self.worker.loaded_bytes += t.numel() * t.element_size()
        return t

    def __getattr__(self, name: str):
        return getattr(self.src, name)


class DeviceWorker:
    def __init__(self, rank: int, world: int, device: str, allow_faults: bool = False) -> None:
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.allow_faults = allow_faults
        self.telemetry = TelemetrySampler(self.device, _cpu_isa() if self.device.type == "cpu" else "")
        self.model: Model | None = None
        self.runner: ModelRunner | None = None
        self.model_id: str | None = None
        self.busy_step = -1
        self.loaded_bytes = 0  # read by the heartbeat: a load's progress
        self.pending_fault: str | None = None
        self.dist_ready = world == 1
        self.collective_s = 60.0  # how long a collective waits for the other ranks (InitDist says)
        self.late_masks = LateMasks()  # filled by the socket loop's thread (StepMasks)

    # Every handler returns the reply frame, a Deferred one (a launched step), or None when this
    # rank stays silent.
    def handle(self, msg: p.Request) -> p.Reply | Deferred | None:
        try:
            return self._dispatch(msg)
        except (RankFailure, StepRejected) as exc:
            kind = exc.kind if isinstance(exc, RankFailure) else "bad_request"
            return p.Error(id=msg.id, epoch=msg.epoch, kind=kind, message=str(exc))
        except torch.OutOfMemoryError as exc:
            return p.Error(id=msg.id, epoch=msg.epoch, kind="oom", message=f"out of memory: {exc}"[:2000])
        except Exception as exc:  # a failure of this rank, reported, never a crash
            log.exception("rank %d: %s failed", self.rank, type(msg).__name__)
            kind = "device_fault" if self.device.type == "cuda" and "CUDA" in str(exc) else "failed"
            return p.Error(id=msg.id, epoch=msg.epoch, kind=kind, message=f"{type(exc).__name__}: {exc}"[:2000])

    def _dispatch(self, msg: p.Request) -> p.Reply | Deferred | None:
        ids = {"id": msg.id, "epoch": msg.epoch}
        match msg:
            case p.InitDist():
                self._init_dist(msg)
                return p.InitOk(**ids)
            case p.SanityCheck():
                ones = torch.ones(1, device=self.device)
                if self.world > 1:
                    dist.all_reduce(ones)
                return p.SanityResult(**ids, observed=float(ones.item()))
            case p.LoadShard():
                return self._load(msg)
            case p.Step():
                return self._step(msg)
            case p.Free():  # slots restart with their next sequence's first step: nothing to do
                return p.Freed(**ids)
            case p.Memory():
                return self._memory(msg)
            case p.Unload():
                self._unload()
                return p.Unloaded(**ids)
            case p.InjectFault():
                if not self.allow_faults:
                    raise RankFailure("bad_request", "fault injection is not enabled on this rank")
                self.pending_fault = msg.kind
                return p.FaultArmed(**ids, kind=msg.kind)
        raise RankFailure("unknown_op", f"rank cannot handle {type(msg).__name__}")

    def _init_dist(self, msg: p.InitDist) -> None:
        if msg.world == 1:
            self.dist_ready = True
            return
        self.collective_s = msg.timeout_s
        kwargs = {}
        if msg.backend == "nccl":
            kwargs["device_id"] = self.device
        dist.init_process_group(
            backend=msg.backend, init_method=msg.rendezvous, world_size=msg.world, rank=msg.rank,
            timeout=timedelta(seconds=msg.timeout_s), **kwargs,
        )
        self.dist_ready = True

    def _load(self, msg: p.LoadShard) -> p.LoadOk:
        if not self.dist_ready:
            raise RankFailure("not_initialised", "init_dist must come before load_shard")
        self._unload()
        dtype, state_dtype = DTYPES.get(msg.dtype), DTYPES.get(msg.state_dtype)
        if dtype is None or state_dtype is None:
            raise RankFailure("bad_request", f"unknown dtype {msg.dtype!r} or state_dtype {msg.state_dtype!r}")
        if not -1 <= msg.state_snapshots <= 65536:
            raise RankFailure("bad_request", "state_snapshots must be in -1..65536")
        if not 0 < msg.max_slots <= 4096 or not 0 < msg.max_len <= 1 << 24 or not 0 < msg.block_size <= 4096:
            raise RankFailure("bad_request", "max_slots, max_len and block_size must be positive and sane")
        if msg.host_bytes < 0 or msg.disk_bytes < 0:
            raise RankFailure("bad_request", "host_bytes and disk_bytes must be >= 0")
        if not 0 <= msg.draft_rows <= msg.max_slots * (p.MAX_DRAFTS + 1):
            raise RankFailure("bad_request", "draft_rows must be within max_slots x (MAX_DRAFTS + 1)")
        t0 = time.perf_counter()
        if msg.format == "gguf":
            from neuron.loader.gguf_open import open_gguf
            src = open_gguf(msg.paths[0], msg.config)
        else:
            from neuron.loader.safetensors_source import SafetensorsSource
            src = SafetensorsSource(msg.paths)
            if msg.checkpoint_quant is not None:
                from neuron.loader.published import PublishedSource
                src = PublishedSource(src, msg.checkpoint_quant, self.device if self.device.type == "cuda" else None)
        if msg.quant:
            from neuron.loader.insitu import QuantizingSource
            if msg.quant not in SCHEMES:
                raise RankFailure("bad_request", f"unknown quant {msg.quant!r} (known: {', '.join(SCHEMES)})")
            src = QuantizingSource(src, msg.quant, self.device if self.device.type == "cuda" else None)
        packed = packed_kernel_for(self.device, dtype) and bool(getattr(src, "quantized", False))
        if getattr(src, "quantized", False) and not packed:
            log.warning("rank %d: %s's quantized weights are dequantized to %s on %s (the packed kernels take "
                        "bfloat16 activations on the CPU)", self.rank, msg.model, msg.dtype, self.device.type)
        family = families.family(msg.config.family)
        if family is None:
            raise RankFailure("bad_request", f"no model family serves {msg.config.family!r}")
        self.loaded_bytes = 0
        world, rank, kwargs = self.world, self.rank, {}
        if msg.pipeline > 1:
            world, rank, kwargs["stage"] = self._stage(msg, family)
        if msg.mtp:
            if not hasattr(family, "mtp_refused") or msg.pipeline > 1 or msg.format != "safetensors":
                raise RankFailure("bad_request", f"the {msg.config.family} family loads no MTP layer here")
            kwargs["mtp"] = True
        try:
            self.model = family.build(msg.config, world, rank, _Counted(src, self), dtype=dtype, device=self.device,
                                      max_len=msg.max_len, block=GROUP if packed else 1, **kwargs)
        except ShardingError as exc:
            raise RankFailure("bad_request", str(exc)) from None
        del src
        self.runner = ModelRunner(self.model, RunnerConfig(
            max_seqs=msg.max_slots, max_len=msg.max_len, block_size=msg.block_size, kv_tokens=msg.kv_tokens,
            memory_fraction=msg.memory_fraction, max_step_tokens=msg.max_step_tokens,
            cuda_graphs=msg.cuda_graphs, state_dtype=state_dtype, state_snapshots=msg.state_snapshots,
            draft_rows=msg.draft_rows, host_bytes=msg.host_bytes, collective_s=self.collective_s,
            disk=(msg.disk_dir, msg.disk_bytes, msg.model, msg.disk_identity)), self.rank)
        self.model_id = msg.model
        self._warm_up()
        runner = self.runner
        decode_ms, prefill_ms = step_times.measure(runner) if self.device.type == "cuda" else ([], [])
        if prefill_ms:
            log.info("rank %d: decode steps %s ms, prompt steps %s ms (rows: ms)", self.rank,
                     ", ".join(f"{b}: {ms:.2f}" for b, ms in decode_ms), ", ".join(f"{n}: {ms:.2f}" for n, ms in prefill_ms))
        packing = describe_packing(self.model)
        disk = runner.host.disk if runner.host is not None else None
        cpu_isa = _cpu_isa() if self.device.type == "cpu" else ""
        log.info("rank %d loaded %s shard in %.2fs: %d weight bytes, %d KV blocks of %d; %s; CPU kernels %s", self.rank,
                 msg.model, time.perf_counter() - t0, self.model.weight_bytes(), runner.kv_blocks, msg.block_size,
                 packing, cpu_isa or "-")
        return p.LoadOk(id=msg.id, epoch=msg.epoch, kv_capacity=runner.kv_blocks * msg.block_size,
                        bytes=self.model.weight_bytes(), kv_bytes=runner.kv.nbytes, kv_blocks=runner.kv_blocks,
                        graphs=sorted(runner.graphs), packing=packing, state_slots=runner.states.slots,
                        state_bytes=runner.states.nbytes, state_snapshots=runner.state_snapshots, cpu_isa=cpu_isa,
                        host_blocks=runner.host.slots if runner.host is not None else 0,
                        disk_blocks=disk.capacity // disk.file_bytes if disk else 0,
                        disk_hashes=disk.hashes() if disk else [],
                        state_pieces=runner.host.pieces if runner.host is not None else 0,
                        decode_ms=decode_ms, prefill_ms=prefill_ms)

    def _stage(self, msg: p.LoadShard, family) -> tuple[int, int, Stage]:
        """This rank's pipeline stage: its tensor-parallel group (every rank creates every
        stage's group, in order, as torch.distributed asks), its layers."""
        stages = msg.pipeline
        if not getattr(family, "PIPELINE", False):
            raise RankFailure("bad_request", f"the {msg.config.family} family has no pipeline-parallel split")
        if self.world % stages or not 0 < stages <= msg.config.num_layers:
            raise RankFailure("bad_request", f"{self.world} ranks do not form {stages} pipeline stages of "
                                             f"{msg.config.num_layers} layers")
        tensor = self.world // stages
        groups = [dist.new_group(list(range(s * tensor, (s + 1) * tensor))) for s in range(stages)] \
            if tensor > 1 else [None] * stages
        index = self.rank // tensor
        stage = Stage(index, stages, tensor, stage_layers(msg.config.num_layers, stages, index), groups[index])
        return tensor, self.rank % tensor, stage

    def _warm_up(self) -> None:
        """One prompt chunk and one decode through every layer, so the first request does not pay
        for lazy allocations and kernel selection. Every rank runs it (the collectives pair up)."""
        assert self.runner is not None
        n = min(8, self.runner.cfg.max_len - 1)
        state = 0 if self.runner.states.slots else -1
        first = p.StepSeq(slot=0, tokens=[0] * n, start_pos=0, sample=True, sampling=p.Sampling(temperature=0.0),
                          blocks=list(range(min(self.runner.kv_blocks, -(-(n + 1) // self.runner.bs)))), state=state)
        for seq in (first, p.StepSeq(slot=0, tokens=[-1], start_pos=n, sample=True, state=state)):
            pending = self.runner.step(p.Step(id=0, epoch=0, step_id=0, seqs=[seq]))
            if pending is not None:
                pending.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _unload(self) -> None:
        if self.runner is not None and self.runner.host is not None:
            self.runner.host.close()
        self.model = None
        self.runner = None
        self.model_id = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _memory(self, msg: p.Memory) -> p.MemoryInfo:
        kv = self.runner.kv.nbytes if self.runner else 0
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
        else:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            free, total = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), pages
        return p.MemoryInfo(id=msg.id, epoch=msg.epoch, free=int(free), total=int(total), kv_used=kv)

    def _step(self, msg: p.Step) -> Deferred | None:
        if self.runner is None:
            raise RankFailure("model_not_loaded", "step before load_shard")
        if self.pending_fault == "oom":
            self.pending_fault = None
            raise torch.OutOfMemoryError("injected out-of-memory (test hook)")
        self.busy_step = msg.step_id
        try:
            pending = self.runner.step(msg, self.late_masks)
        except BaseException:
            self.busy_step = -1
            raise
        if pending is None:
            self.busy_step = -1
            return None
        return Deferred(lambda: self._collect(msg, pending))

    def _collect(self, msg: p.Step, pending: PendingStep) -> p.Reply:
        """On the collector thread: the step's reply once the device has finished it."""
        try:
            tokens, logprobs, timings, drafted = pending.wait()
        except Exception as exc:  # a device fault surfaces at the sync
            log.exception("rank %d: step %d failed on the device", self.rank, msg.step_id)
            kind = "device_fault" if "CUDA" in str(exc) else "failed"
            return p.Error(id=msg.id, epoch=msg.epoch, kind=kind, message=f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            if self.busy_step == msg.step_id:
                self.busy_step = -1
        host = self.runner.host if self.runner is not None else None
        fetched, lost = host.disk_news() if host is not None else ([], [])
        return p.StepResult(id=msg.id, epoch=msg.epoch, step_id=msg.step_id, tokens=tokens, timings=timings,
                            logprobs=logprobs, drafted=drafted, proposals=pending.proposals,
                            disk_fetched=fetched, disk_lost=lost)

    def close(self) -> None:
        self._unload()
        if self.world > 1 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer may already be gone
                pass


def _cpu_isa() -> str:
    """The level of the CPU kernels this rank runs, "none" where they are not built."""
    from neuron.kernels.cpu import KernelUnavailable, cpu_kernels

    try:
        return cpu_kernels().isa
    except KernelUnavailable:
        return "none"
