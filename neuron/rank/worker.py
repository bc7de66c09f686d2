"""Everything a rank does with torch. Runs only on the rank's one device executor thread."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import protocol as p
from neuron.models.layers import attention_batch
from neuron.models.llama import CausalLM
from neuron.models.linear import describe_packing, packed_kernel_for
from neuron.models.quant import GROUP, SCHEMES
from neuron.models.sharding import ShardingError, plan_shard

from .sampler import Sampler

log = logging.getLogger("neuron.rank")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RankFailure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class DeviceWorker:
    def __init__(self, rank: int, world: int, device: str, allow_faults: bool = False) -> None:
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.allow_faults = allow_faults
        self.model: CausalLM | None = None
        self.model_id: str | None = None
        self.sampler = Sampler(self.device)
        self.busy_step = -1
        self.pending_fault: str | None = None
        self.dist_ready = world == 1

    # Every handler returns the reply frame, or None when this rank stays silent.
    def handle(self, msg: p.Request) -> p.Reply | None:
        try:
            return self._dispatch(msg)
        except RankFailure as exc:
            return p.Error(id=msg.id, epoch=msg.epoch, kind=exc.kind, message=str(exc))
        except torch.OutOfMemoryError as exc:
            return p.Error(id=msg.id, epoch=msg.epoch, kind="oom", message=f"out of memory: {exc}"[:2000])
        except Exception as exc:  # a failure of this rank, reported, never a crash
            log.exception("rank %d: %s failed", self.rank, type(msg).__name__)
            kind = "device_fault" if self.device.type == "cuda" and "CUDA" in str(exc) else "failed"
            return p.Error(id=msg.id, epoch=msg.epoch, kind=kind, message=f"{type(exc).__name__}: {exc}"[:2000])

    def _dispatch(self, msg: p.Request) -> p.Reply | None:
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
            case p.Free():
                for slot in msg.slots:
                    self.sampler.free(slot)
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
        dtype = DTYPES.get(msg.dtype)
        if dtype is None:
            raise RankFailure("bad_request", f"unknown dtype {msg.dtype!r}")
        t0 = time.perf_counter()
        if msg.format == "gguf":
            from neuron.loader.gguf_source import GgufSource
            src = GgufSource(msg.paths[0], num_heads=msg.config.num_heads, num_kv_heads=msg.config.num_kv_heads)
        else:
            from neuron.loader.safetensors_source import SafetensorsSource
            src = SafetensorsSource(msg.paths)
        if msg.quant:
            from neuron.loader.insitu import QuantizingSource
            if msg.quant not in SCHEMES:
                raise RankFailure("bad_request", f"unknown quant {msg.quant!r} (known: {', '.join(SCHEMES)})")
            src = QuantizingSource(src, msg.quant)
        packed = packed_kernel_for(self.device, dtype) and bool(getattr(src, "quantized", False))
        if getattr(src, "quantized", False) and not packed:
            log.warning("rank %d: %s's quantized weights are dequantized to %s on %s (the packed kernels take "
                        "bfloat16 activations on the CPU)", self.rank, msg.model, msg.dtype, self.device.type)
        try:
            plan = plan_shard(msg.config, self.world, self.rank, block=GROUP if packed else 1)
        except ShardingError as exc:
            raise RankFailure("bad_request", str(exc)) from None
        self.model = CausalLM(msg.config, plan, src, dtype=dtype, device=self.device,
                              max_slots=msg.max_slots, max_len=msg.max_len)
        self.model_id = msg.model
        del src
        self._warm_up()
        packing = describe_packing(self.model)
        log.info("rank %d loaded %s shard in %.2fs: %d weight bytes; %s", self.rank, msg.model,
                 time.perf_counter() - t0, self.model.weight_bytes(), packing)
        return p.LoadOk(id=msg.id, epoch=msg.epoch, kv_capacity=msg.max_slots * msg.max_len,
                        bytes=self.model.weight_bytes(), kv_bytes=self.model.kv.nbytes, packing=packing)

    def _warm_up(self) -> None:
        """One prefill and one decode through every layer, so the first request does not pay for
        lazy allocations and kernel selection. Every rank runs it (the collectives pair up)."""
        assert self.model is not None
        n = min(8, self.model.kv.max_len - 1)
        for start, count in ((0, n), (n, 1)):
            batch = attention_batch([(0, start, count)], self.device)
            ids = torch.zeros(count, dtype=torch.long, device=self.device)
            self.model.forward(ids, batch, torch.tensor([count - 1], device=self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _unload(self) -> None:
        self.model = None
        self.model_id = None
        self.sampler = Sampler(self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _memory(self, msg: p.Memory) -> p.MemoryInfo:
        kv = self.model.kv.nbytes if self.model else 0
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
        else:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            free, total = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), pages
        return p.MemoryInfo(id=msg.id, epoch=msg.epoch, free=int(free), total=int(total), kv_used=kv)

    def _step(self, msg: p.Step) -> p.StepResult | None:
        model = self.model
        if model is None:
            raise RankFailure("model_not_loaded", "step before load_shard")
        if self.pending_fault == "oom":
            self.pending_fault = None
            raise torch.OutOfMemoryError("injected out-of-memory (test hook)")
        self.busy_step = msg.step_id
        try:
            t0 = time.perf_counter()
            for s in msg.seqs:
                if (s.start_pos < 0 or s.start_pos + len(s.tokens) > model.kv.max_len
                        or not 0 <= s.slot < model.kv.slots or not s.tokens):
                    raise RankFailure("bad_request", f"seq in slot {s.slot} does not fit the KV cache")
                if s.sampling is not None and any(not 0 <= t < model.cfg.vocab_size for t, _ in s.sampling.logit_bias):
                    raise RankFailure("bad_request", f"logit_bias of slot {s.slot} names a token outside the vocabulary")
                if s.allowed is not None and len(s.allowed) != 4 * ((model.cfg.vocab_size + 31) // 32):
                    raise RankFailure("bad_request", f"token mask of slot {s.slot} does not match the vocabulary")
            ids = torch.tensor([t for s in msg.seqs for t in s.tokens], device=self.device)
            batch = attention_batch([(s.slot, s.start_pos, len(s.tokens)) for s in msg.seqs], self.device)
            sampled = [i for i, s in enumerate(msg.seqs) if s.sampling is not None]
            ends, offset = [], 0
            for s in msg.seqs:
                offset += len(s.tokens)
                ends.append(offset - 1)
            last = torch.tensor([ends[i] for i in sampled], device=self.device, dtype=torch.long)
            logits = model.forward(ids, batch, last)
            if self.rank != 0:
                return None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t1 = time.perf_counter()
            for s in msg.seqs:
                self.sampler.feed(s.slot, s.start_pos, s.tokens)
            tokens = [-1] * len(msg.seqs)
            logprobs = None
            if sampled:
                chosen, lps = self.sampler.sample(
                    logits, [msg.seqs[i].slot for i in sampled], [msg.seqs[i].sampling for i in sampled],
                    [msg.seqs[i].allowed for i in sampled])
                for i, tok in zip(sampled, chosen):
                    tokens[i] = tok
                if lps is not None:
                    logprobs = [[] for _ in msg.seqs]
                    for i, entry in zip(sampled, lps):
                        logprobs[i] = entry
            t2 = time.perf_counter()
            return p.StepResult(id=msg.id, epoch=msg.epoch, step_id=msg.step_id, tokens=tokens,
                                timings=p.StepTimings(forward_ms=(t1 - t0) * 1e3, sample_ms=(t2 - t1) * 1e3),
                                logprobs=logprobs)
        finally:
            self.busy_step = -1

    def close(self) -> None:
        self._unload()
        if self.world > 1 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer may already be gone
                pass
