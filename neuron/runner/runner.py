"""The rank's model runner: everything between a ``step`` frame and the device.

It owns the paged KV cache (sized from the device memory left after the weights), the block
tables the leader fills, the device sampler, and on CUDA the fused kernels and one CUDA graph
per decode batch-size bucket. A step whose sequences are all single-token decodes and fit a
bucket replays that bucket's graph. A step with prompt chunks of up to ``PREFILL_GRAPH_TOKENS``
tokens in all (a question after a cached prefix, a chunk beside running decodes) replays a
prefill graph: every sequence of it, decodes included, is a span of the paged prefill kernel,
so one graph per token bucket serves any mix. Longer steps, and the CPU, run eagerly: there
the device's work outweighs the host's launches.

A step is launched, not waited for: ``step`` returns a ``PendingStep`` whose ``wait`` blocks
until the step's tokens reach the host (one copy per step). The device thread can meanwhile
launch the next step, which takes its decode inputs from the tokens this one leaves on the device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

import protocol as p
from neuron.models.llama import CausalLM

from .attention import PagedAttention, PagedKvCache, PrefillBatch, PrefillSpan, StepMeta
from .sampler import DeviceSampler, check_sampling, upload

log = logging.getLogger("neuron.runner")

DEVICE_TOKEN = -1  # a decode input the rank takes from its last draw for the slot
# Token buckets of the prefill graphs. A 50-token step launches ~300 kernels eagerly, about 20 ms
# of host time around a few ms of device work.
PREFILL_GRAPH_TOKENS = (32, 64, 128, 192, 256, 320, 384, 512)


class StepRejected(ValueError):
    """The step cannot run as sent (a leader bug or a forged frame): bad_request, nothing ran."""


def graph_sizes(max_seqs: int) -> list[int]:
    sizes = [n for n in (1, 2, 4, 8) if n < max_seqs] + list(range(16, max_seqs, 16))
    return sorted(set(sizes + [max_seqs]))


@dataclass
class RunnerConfig:
    max_seqs: int
    max_len: int
    block_size: int = 16
    kv_tokens: int = 0  # 0: as many as the device memory allows (CUDA only)
    memory_fraction: float = 0.9
    max_step_tokens: int = 2048
    cuda_graphs: bool = True


@dataclass
class PendingStep:
    """A launched step; ``wait`` returns its StepResult fields once its tokens are on the host."""

    n_seqs: int
    rows: list[int]  # the seq index of each sampled row
    want: list[int]  # logprobs asked by each sampled row
    tokens: torch.Tensor  # [R] int64 host (pinned on CUDA)
    logprobs: tuple[torch.Tensor, ...] | None
    ready: torch.cuda.Event | None
    started: float
    host_ms: float
    # The device's idle gap before this step: from the last step's end to this one's first kernel.
    gap: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def wait(self) -> tuple[list[int], list[list[tuple[int, float]]] | None, p.StepTimings]:
        if self.ready is not None:
            # Poll rather than block in the driver: the device thread must keep the GIL's turn to
            # launch the next step while this one runs.
            while not self.ready.query():
                time.sleep(20e-6)
        device_ms = (time.perf_counter() - self.started) * 1e3
        idle_ms = self.gap[0].elapsed_time(self.gap[1]) if self.gap is not None else 0.0
        tokens = [-1] * self.n_seqs
        for seq, tok in zip(self.rows, self.tokens.tolist()):
            tokens[seq] = tok
        logprobs = None
        if self.logprobs is not None:
            chosen, values, ids = (t.tolist() for t in self.logprobs)
            logprobs = [[] for _ in range(self.n_seqs)]
            for r, (seq, n) in enumerate(zip(self.rows, self.want)):
                if n:
                    top = list(zip(ids[r][: n - 1], values[r][: n - 1]))
                    logprobs[seq] = [(tokens[seq], chosen[r]), *top]
        return tokens, logprobs, p.StepTimings(forward_ms=device_ms, host_ms=self.host_ms, idle_ms=idle_ms)


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: RunnerConfig, rank: int) -> None:
        self.model, self.cfg, self.rank = model, cfg, rank
        self.device = model.device
        self.cuda = self.device.type == "cuda"
        self.vocab = model.cfg.vocab_size
        self.bs = cfg.block_size
        self.max_blocks = -(-cfg.max_len // self.bs)
        self.scratch_row = cfg.max_seqs  # the table row of padded graph rows
        shape = model.attention_shape
        self.triton = self.cuda and _triton_fits(shape.head_dim)
        if self.triton:
            from neuron.models.linear import has_packed
            from neuron.kernels.gpu import pdl_by_default

            from .ops import TritonOps
            model.ops = TritonOps(model.ops, int8_rows=has_packed(model))
            pdl_by_default(model.comm.world == 1)
            self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.cpu_kernels = _cpu_kernels() if self.device.type == "cpu" and model.dtype == torch.float32 else None
        if self.cpu_kernels is not None:
            from .ops import CpuOps
            model.ops = CpuOps(model.ops, self.cpu_kernels)
        blocks = self._size_kv()
        self.kv = PagedKvCache(model.cfg.num_layers, blocks, self.bs, shape.n_kv, shape.head_dim,
                               self.device, model.dtype)
        self.tables_host = np.full((cfg.max_seqs + 1, self.max_blocks), self.kv.scratch, dtype=np.int32)
        self.tables = torch.from_numpy(self.tables_host).to(self.device)
        self.assigned = [0] * cfg.max_seqs  # table entries the leader has filled, per slot
        self.attention = PagedAttention(self.kv, self.tables, shape, self.triton, cfg.max_seqs + 1, self.cpu_kernels,
                                        model.ops.int8_rows if self.triton else 0)
        self.sampler = DeviceSampler(cfg.max_seqs + 1, self.vocab, self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._last_end: torch.cuda.Event | None = None
        if self.cuda:
            self._outs = [torch.zeros(cfg.max_seqs, dtype=torch.int64).pin_memory() for _ in range(4)]
            self._out = 0
        self.graph_in: torch.Tensor | None = None
        if self.cuda and model.comm.world > 1:
            rows = max(graph_sizes(cfg.max_seqs) + list(PREFILL_GRAPH_TOKENS))
            how = model.comm.use_peer_memory(rows * model.cfg.hidden_size, model.dtype, self.device)
            log.info("rank %d: all-reduces of up to %d rows: %s", rank, rows, how)
        if self.cuda and cfg.cuda_graphs and model.capturable and self.triton:
            from .linear import tune, tune_packed
            tune(model, graph_sizes(cfg.max_seqs))
            tune_packed(model, graph_sizes(cfg.max_seqs))
            try:
                self._capture()
            except RuntimeError as exc:  # e.g. a collective the driver cannot capture: run eagerly
                log.warning("rank %d: CUDA graph capture failed, decode steps run eagerly: %s", rank, exc)
                self.graphs.clear()
                self.prefill_graphs.clear()
                torch.cuda.synchronize(self.device)

    @property
    def kv_blocks(self) -> int:
        return self.kv.blocks

    # ----------------------------------------------------------------------------- memory
    def _size_kv(self) -> int:
        cfg, shape = self.cfg, self.model.attention_shape
        per_block = PagedKvCache.bytes_per_block(self.model.cfg.num_layers, self.bs, shape.n_kv, shape.head_dim,
                                                 self.model.dtype)
        if cfg.kv_tokens or not self.cuda:
            tokens = cfg.kv_tokens or cfg.max_seqs * self.max_blocks * self.bs
            return max(1, -(-tokens // self.bs))
        # What one step of the largest size needs beyond the weights, measured on a throwaway cache.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        n = max(1, min(cfg.max_step_tokens, cfg.max_len))
        probe = PagedKvCache(self.model.cfg.num_layers, -(-n // self.bs), self.bs, shape.n_kv, shape.head_dim,
                             self.device, self.model.dtype)
        tables = torch.arange(probe.blocks, device=self.device, dtype=torch.int32)[None]
        attention = PagedAttention(probe, tables, shape, self.triton)
        rows = torch.arange(n, device=self.device)
        attention.meta = StepMeta(store_index=rows, decode_rows=rows[:0])
        if self.triton:
            attention.meta.prefill_spans = torch.tensor([[0, n, 0, 0]], dtype=torch.int32, device=self.device)
            attention.meta.prefill_max_n = n
        else:
            attention.meta.prefills = [PrefillSpan(0, n, rows)]
        self.model.forward(torch.zeros(n, dtype=torch.long, device=self.device), rows, attention, rows[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before - probe.nbytes
        del probe, attention, tables, rows
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        sampler_bytes = 6 * (cfg.max_seqs + 1) * self.vocab  # penalty state, if any sequence wants it
        budget = total * cfg.memory_fraction - (total - free) - peak - sampler_bytes - (256 << 20)
        blocks = int(budget // per_block)
        if blocks < self.max_blocks:
            raise torch.OutOfMemoryError(
                f"the KV cache would hold {max(0, blocks) * self.bs} tokens, less than one sequence of "
                f"max_model_len={cfg.max_len}: raise memory_fraction or lower max_model_len")
        log.info("rank %d: KV cache of %d blocks (%d tokens, %.2f GiB); a %d-token step peaks at %.2f GiB",
                 self.rank, blocks, blocks * self.bs, blocks * per_block / 2**30, n, peak / 2**30)
        return blocks

    # ----------------------------------------------------------------------------- a step
    def step(self, msg: p.Step) -> PendingStep | None:
        """Launch one step; rank 0 returns what to wait for, the others None."""
        t0 = time.perf_counter()
        gap = None
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            gap = (self._last_end, begin) if self._last_end is not None else None
        seqs = msg.seqs
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        bucket, ids, positions, slot_t, logits, argmax = self._forward(seqs, sampled)
        rows_slots = [seqs[i].slot for i in sampled]
        every_token_sampled = bucket and len(sampled) == len(seqs)  # then token rows are sampled rows
        slot_rows = slot_t if every_token_sampled else upload(rows_slots, torch.int64, self.device)
        if self.rank == 0 and self.sampler.penalised([s.slot for s in seqs]):
            self.sampler.feed(slot_t, ids, positions)
        if not sampled:
            tokens, logprobs = torch.zeros(0, dtype=torch.int64, device=self.device), None
        elif self.rank == 0:
            last = [seqs[i].start_pos + len(seqs[i].tokens) - 1 for i in sampled]
            tokens, logprobs = self.sampler.sample(logits, rows_slots, slot_rows, last,
                                                   [seqs[i].allowed for i in sampled],
                                                   argmax if every_token_sampled else None)
        else:
            tokens, logprobs = torch.empty(len(sampled), dtype=torch.int64, device=self.device), None
        if sampled and self.model.comm.world > 1:
            # Every rank feeds the next step's device tokens into its embedding: they must be rank 0's.
            self.model.comm.broadcast(tokens)
            if self.rank != 0:
                self.sampler.last_token[slot_rows] = tokens
        if self.rank != 0:
            return None
        want = [self.sampler.params[s].logprobs for s in rows_slots]
        ready = None
        if self.cuda:
            tokens = self._to_host(tokens)
            if logprobs is not None:
                logprobs = tuple(t.to("cpu", non_blocking=True) for t in logprobs)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
            self._last_end = ready
        return PendingStep(len(seqs), sampled, want, tokens, logprobs, ready, t0,
                           (time.perf_counter() - t0) * 1e3, gap)

    def forward_logits(self, seqs: list[p.StepSeq], every_position: bool = False) -> torch.Tensor:
        """The logits of a step without sampling (parity checks): [sampled seqs, V], or with
        ``every_position`` [tokens, V] (run eagerly)."""
        return self._forward(seqs, [i for i, s in enumerate(seqs) if s.sample], every_position)[-2]

    def _forward(self, seqs: list[p.StepSeq], sampled: list[int], every_position: bool = False):
        self._check(seqs)
        self._update_tables(seqs)
        for s in seqs:
            if s.sampling is not None:
                self.sampler.start(s.slot, s.sampling)
                if s.context and self.rank == 0 and self.sampler.penalised([s.slot]):
                    n = len(s.context)
                    at = upload([[s.slot] * n, s.context, list(range(n))], torch.int64, self.device)
                    self.sampler.feed(at[0], at[1], at[2])
        bucket = 0 if every_position else self._bucket(seqs)
        if not bucket:
            tokens = 0 if every_position else self._prefill_bucket(seqs)
            if tokens:
                return (0, *self._replay_prefill(seqs, sampled, tokens), None)
            return (0, *self._eager(seqs, sampled, every_position), None)
        ids, positions, slot_t, logits, argmax = self._replay(seqs, bucket)
        if len(sampled) < len(seqs):
            logits = logits[upload(sampled, torch.int64, self.device)]
        return bucket, ids, positions, slot_t, logits, argmax

    def _to_host(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step's tokens into one of a few pinned host buffers (see _staging)."""
        if tokens.numel() > self.cfg.max_seqs:
            return tokens.to("cpu", non_blocking=True)
        self._out = (self._out + 1) % len(self._outs)
        out = self._outs[self._out][: tokens.numel()]
        out.copy_(tokens, non_blocking=True)
        return out

    def _check(self, seqs: list[p.StepSeq]) -> None:
        slots: set[int] = set()
        for s in seqs:
            n = len(s.tokens)
            if not 0 <= s.slot < self.cfg.max_seqs or s.slot in slots:
                raise StepRejected(f"slot {s.slot} is out of range or twice in the step")
            slots.add(s.slot)
            if not n or s.start_pos < 0 or s.start_pos + n > self.cfg.max_len:
                raise StepRejected(f"seq in slot {s.slot} does not fit the context ({self.cfg.max_len} tokens)")
            if s.tokens == [DEVICE_TOKEN]:
                if s.start_pos == 0:
                    raise StepRejected(f"slot {s.slot}: a device token cannot start a sequence")
            elif any(not 0 <= t < self.vocab for t in s.tokens):
                raise StepRejected(f"seq in slot {s.slot} has a token outside the vocabulary")
            if s.block_start < 0 or s.block_start + len(s.blocks) > self.max_blocks:
                raise StepRejected(f"slot {s.slot}: block table entries out of range")
            if any(not 0 <= b < self.kv.blocks for b in s.blocks):
                raise StepRejected(f"slot {s.slot}: a block outside the KV cache")
            # A new sequence (sampling set) fills its table from entry 0; later steps only extend it.
            before = 0 if s.sampling is not None else self.assigned[s.slot]
            if s.blocks and s.block_start > before:
                raise StepRejected(f"slot {s.slot}: block table entries would leave a gap")
            assigned = max(before, s.block_start + len(s.blocks)) if s.blocks else before
            if assigned * self.bs < s.start_pos + n:
                raise StepRejected(f"slot {s.slot}: positions up to {s.start_pos + n} have no KV blocks")
            if s.sampling is not None:
                why = check_sampling(s.sampling, self.vocab)
                if why:
                    raise StepRejected(f"slot {s.slot}: {why}")
            if s.allowed is not None and len(s.allowed) != 4 * ((self.vocab + 31) // 32):
                raise StepRejected(f"slot {s.slot}: the token mask does not match the vocabulary")
            if s.context and (s.sampling is None or len(s.context) != s.start_pos
                              or any(not 0 <= t < self.vocab for t in s.context)):
                raise StepRejected(f"slot {s.slot}: context must be the sequence's tokens before start_pos")

    def _update_tables(self, seqs: list[p.StepSeq]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        for s in seqs:
            if s.sampling is not None:
                self.assigned[s.slot] = 0
            if s.blocks:
                end = s.block_start + len(s.blocks)
                self.tables_host[s.slot, s.block_start: end] = s.blocks
                self.assigned[s.slot] = max(self.assigned[s.slot], end)
                rows += [s.slot] * len(s.blocks)
                cols += range(s.block_start, end)
                values += s.blocks
        if values:
            at = upload([rows, cols], torch.int64, self.device)
            self.tables.index_put_((at[0], at[1]), upload(values, torch.int32, self.device))

    def _bucket(self, seqs: list[p.StepSeq]) -> int:
        if not self.graphs or not seqs or any(len(s.tokens) != 1 for s in seqs):
            return 0
        return next((n for n in sorted(self.graphs) if n >= len(seqs)), 0)

    # ----------------------------------------------------------------------------- eager
    def _flatten(self, seqs: list[p.StepSeq]):
        """The step's tokens as rows: (ids, positions, slots, cache rows) [T] each, the rows of the
        single-token decodes, (row, n, slot, start) of each prompt chunk, each sequence's last row."""
        T = sum(len(s.tokens) for s in seqs)
        ids = np.empty(T, dtype=np.int64)
        positions = np.empty(T, dtype=np.int64)
        slot_of = np.empty(T, dtype=np.int64)
        decode_rows: list[int] = []
        prefills: list[tuple[int, int, int, int]] = []  # row, n, slot, start
        ends: list[int] = []
        row = 0
        for s in seqs:
            n = len(s.tokens)
            ids[row: row + n] = s.tokens
            positions[row: row + n] = np.arange(s.start_pos, s.start_pos + n)
            slot_of[row: row + n] = s.slot
            if n == 1:
                decode_rows.append(row)
            else:
                prefills.append((row, n, s.slot, s.start_pos))
            row += n
            ends.append(row - 1)
        store = self.tables_host[slot_of, positions // self.bs].astype(np.int64) * self.bs + positions % self.bs
        return ids, positions, slot_of, store, decode_rows, prefills, ends

    def _eager(self, seqs: list[p.StepSeq], sampled: list[int], every_position: bool = False):
        ids, positions, slot_of, store, decode_rows, prefills, ends = self._flatten(seqs)
        T = len(ids)
        inputs = upload(np.stack([ids, positions, slot_of, store]), torch.int64, self.device)
        ids_t, pos_t, slot_t, store_t = inputs
        ids_t = self._resolve(ids_t, slot_t)
        meta = StepMeta(store_index=store_t, decode_rows=None)
        if len(decode_rows) < T:
            meta.decode_rows = upload(decode_rows, torch.int64, self.device)
        if decode_rows:
            d = np.array(decode_rows)
            ctx = positions[d] + 1
            meta.decode_max_ctx = int(ctx.max())
            if self.triton:
                meta.decode_slots = slot_t[meta.decode_rows] if meta.decode_rows is not None else slot_t
                meta.decode_ctx = upload(ctx, torch.int32, self.device)
                heads = self.model.attention_shape.n_kv if self.model.attention_shape.gqa_repeat else \
                    self.model.attention_shape.n_q
                from neuron.kernels.gpu import decode_splits
                meta.decode_splits = decode_splits(len(d), heads, meta.decode_max_ctx, self.sm_count)
            elif self.cpu_kernels is not None:
                meta.decode_slots = slot_t[meta.decode_rows] if meta.decode_rows is not None else slot_t
                meta.decode_ctx = torch.from_numpy(ctx)
            else:
                C = meta.decode_max_ctx
                keys = self._key_rows(slot_of[d][:, None], np.arange(C)[None, :])
                meta.decode_keys = upload(keys, torch.int64, self.device)
                meta.decode_mask = upload(np.arange(C)[None, :] < ctx[:, None], torch.bool, self.device)[:, None, None, :]
        if prefills and self.triton:  # the kernel reads the keys through the block table itself
            meta.prefill_spans = upload(prefills, torch.int32, self.device)
            meta.prefill_max_n = max(n for _, n, _, _ in prefills)
        elif len(prefills) > 2:
            meta.prefill_batch = self._prefill_batch(prefills)
        else:
            for row, n, slot, start in prefills:
                keys = self._key_rows(np.int64(slot), np.arange(start + n))
                meta.prefills.append(PrefillSpan(row, n, upload(keys, torch.int64, self.device)))
        self.attention.meta = meta
        # A step that samples nothing (a prompt chunk that is not the last) still computes one row.
        rows = upload(list(range(T)) if every_position else [ends[i] for i in sampled] or [T - 1], torch.int64,
                      self.device)
        return ids_t, pos_t, slot_t, self.model.forward(ids_t, pos_t, self.attention, rows)

    def _prefill_batch(self, prefills: list[tuple[int, int, int, int]]) -> PrefillBatch:
        n_max = max(n for _, n, _, _ in prefills)
        c_max = max(start + n for _, n, _, start in prefills)
        rows = np.array([row for row, _, _, _ in prefills])[:, None]
        n = np.array([n for _, n, _, _ in prefills])[:, None]
        start = np.array([start for _, _, _, start in prefills])[:, None]
        slots = np.array([slot for _, _, slot, _ in prefills])[:, None]
        r = np.arange(n_max)[None, :]
        real = r < n  # [S, n_max]
        q_rows = np.where(real, rows + r, 0)
        c = np.arange(c_max)[None, None, :]
        mask = (c <= (start + r)[:, :, None]) & real[:, :, None]  # causal: query r is position start + r
        mask[:, :, 0] |= ~real  # a padding query attends one key, so its (discarded) row stays finite
        keys = self._key_rows(slots, np.minimum(np.arange(c_max)[None, :], (start + n - 1)))
        picked = np.flatnonzero(real)
        up = lambda a, dtype=torch.int64: upload(a, dtype, self.device)  # noqa: E731
        return PrefillBatch(up(q_rows), up(keys), up(mask, torch.bool)[:, None], up(picked), up(q_rows.ravel()[picked]))

    def _key_rows(self, slot: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Flat cache rows of the keys at ``pos`` of the sequences in table rows ``slot``."""
        return self.tables_host[slot, pos // self.bs].astype(np.int64) * self.bs + pos % self.bs

    def _resolve(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Device tokens (-1) become the slot's last draw, still on the device."""
        if self.triton:
            from neuron.kernels.gpu import resolve_tokens
            return resolve_tokens(ids, slots, self.sampler.last_token)
        return torch.where(ids >= 0, ids, self.sampler.last_token[slots])

    # ----------------------------------------------------------------------------- graphs
    def _replay(self, seqs: list[p.StepSeq], bucket: int):
        assert self.graph_in is not None
        B = len(seqs)
        staged = self._staging()
        packed = staged.numpy()
        packed[:] = 0
        packed[2] = self.scratch_row
        for i, s in enumerate(seqs):
            packed[0, i], packed[1, i], packed[2, i], packed[3, i] = s.tokens[0], s.start_pos, s.slot, s.sample
        self.graph_in.copy_(staged, non_blocking=True)
        graph, ids, logits, argmax = self.graphs[bucket]
        graph.replay()
        return ids[:B], self.graph_in[1, :B], self.graph_in[2, :B], logits[:B], argmax[:B]

    def _staging(self) -> torch.Tensor:
        """The next of a few pinned buffers for the graphs' inputs: a fresh pinned allocation per
        step costs more than the step's whole launch. At most two steps are in flight, so a buffer
        is reused only after the copy that read it has run."""
        self._stage = (self._stage + 1) % len(self._staged)
        return self._staged[self._stage]

    def _decode_forward(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The captured decode step of ``n`` rows over the static inputs (token, position, slot
        and whether the row is sampled, a row each): its token ids, logits and their argmax,
        which the step also stores as the sampled rows' last draws (greedy sampling then launches
        nothing after the graph)."""
        assert self.graph_in is not None
        ids, pos, slots = self.graph_in[0, :n], self.graph_in[1, :n], self.graph_in[2, :n]
        ids = self._resolve(ids, slots)
        shape = self.model.attention_shape
        from neuron.kernels.gpu import decode_splits, greedy_tokens
        heads = shape.n_kv if shape.gqa_repeat else shape.n_q
        # The kernels find each row's cache row and context from its slot and position.
        self.attention.meta = StepMeta(
            store_index=None, decode_rows=None, decode_slots=slots, decode_ctx=None,
            decode_max_ctx=self.cfg.max_len, decode_splits=decode_splits(n, heads, self.cfg.max_len, self.sm_count))
        logits = self.model.forward(ids, pos, self.attention, None)
        return ids, logits, greedy_tokens(logits, slots, self.graph_in[3, :n], self.sampler.last_token)

    def _prefill_bucket(self, seqs: list[p.StepSeq]) -> int:
        if not self.prefill_graphs or len(seqs) > self.cfg.max_seqs:
            return 0
        T = sum(len(s.tokens) for s in seqs)
        return next((n for n in sorted(self.prefill_graphs) if n >= T), 0)

    def _replay_prefill(self, seqs: list[p.StepSeq], sampled: list[int], bucket: int):
        """A step of prompt chunks (and decodes beside them) through the prefill graph of
        ``bucket`` tokens: its inputs go up in one copy; padding rows write the scratch block."""
        ids, positions, slot_of, store, _, _, ends = self._flatten(seqs)
        T = len(ids)
        self._pstage = (self._pstage + 1) % len(self._pstaged)
        staged = self._pstaged[self._pstage]
        whole = self._pg_layout(staged.numpy(), self._pg_tokens)
        for name, values, pad in (("ids", ids, 0), ("pos", positions, 0), ("slot", slot_of, self.scratch_row),
                                  ("store", store, self.kv.scratch * self.bs)):
            whole[name][:T] = values
            whole[name][T:] = pad
        whole["spans"][:] = 0
        for i, (s, end) in enumerate(zip(seqs, ends)):
            whole["spans"][i] = (end + 1 - len(s.tokens), len(s.tokens), s.slot, s.start_pos)
        whole["rows"][:] = 0
        whole["rows"][: len(sampled)] = [ends[i] for i in sampled]
        self._pg_in.copy_(staged, non_blocking=True)
        graph, resolved, logits, _ = self.prefill_graphs[bucket]
        graph.replay()
        view = self._pg_layout(self._pg_in, T)
        return resolved[:T], view["pos"], view["slot"], logits[: len(sampled)]

    def _pg_layout(self, buf, n: int) -> dict:
        """The prefill graphs' inputs in one int64 buffer (the device's, or a host staging copy):
        the first ``n`` of each token row's (ids, positions, slots, cache rows), the sequences'
        spans [max_seqs, 4] and the rows to sample [max_seqs]."""
        Tmax, S = self._pg_tokens, self.cfg.max_seqs
        return {"ids": buf[:n], "pos": buf[Tmax: Tmax + n], "slot": buf[2 * Tmax: 2 * Tmax + n],
                "store": buf[3 * Tmax: 3 * Tmax + n], "spans": buf[4 * Tmax: 4 * Tmax + 4 * S].reshape(S, 4),
                "rows": buf[4 * Tmax + 4 * S: 4 * Tmax + 5 * S]}

    def _prefill_forward(self, n: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The captured prefill step of ``n`` token rows over the static inputs."""
        v = self._pg_layout(self._pg_in, n)
        ids = self._resolve(v["ids"], v["slot"])
        # Small steps split each tile's keys four ways: a question after a long cached prefix is a
        # few query tiles over thousands of keys, too few programs to keep the device busy.
        self.attention.meta = StepMeta(store_index=v["store"], decode_rows=v["ids"][:0],
                                       prefill_spans=v["spans"].to(torch.int32), prefill_max_n=n,
                                       prefill_splits=4 if n <= 128 else 1)
        return ids, self.model.forward(ids, v["pos"], self.attention, v["rows"]), None

    def _capture_prefill(self, pool) -> None:
        sizes = [n for n in PREFILL_GRAPH_TOKENS if n <= min(self.cfg.max_step_tokens, self.cfg.max_len)]
        if not sizes:
            return
        Tmax, S = sizes[-1], self.cfg.max_seqs
        self._pg_tokens = Tmax
        self._pg_in = torch.zeros(4 * Tmax + 5 * S, dtype=torch.int64, device=self.device)
        whole = self._pg_layout(self._pg_in, Tmax)  # captured with every row padding
        whole["slot"].fill_(self.scratch_row)
        whole["store"].fill_(self.kv.scratch * self.bs)
        self._pstaged = [torch.zeros(4 * Tmax + 5 * S, dtype=torch.int64).pin_memory() for _ in range(4)]
        self._pstage = 0
        self._capture_each(sizes, self._prefill_forward, self.prefill_graphs, pool)

    def _capture_each(self, sizes: list[int], forward, into: dict, pool):
        """One graph of ``forward(n)`` per size into ``into``, largest first, all in one memory
        pool; returns the pool."""
        for n in reversed(sizes):
            forward(n)  # compiles the kernels and settles the allocator before capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                ids, logits, argmax = forward(n)
            pool = graph.pool()
            into[n] = (graph, ids, logits, argmax)
        return pool

    def _capture(self) -> None:
        t0 = time.perf_counter()
        sizes = graph_sizes(self.cfg.max_seqs)
        self.graph_in = torch.zeros(4, sizes[-1], dtype=torch.int64, device=self.device)
        self.graph_in[2].fill_(self.scratch_row)
        self._staged = [torch.zeros(4, sizes[-1], dtype=torch.int64).pin_memory() for _ in range(4)]
        self._stage = 0
        self._capture_prefill(self._capture_each(sizes, self._decode_forward, self.graphs, None))
        torch.cuda.synchronize(self.device)
        log.info("rank %d: captured %d decode graphs (batch %s) and %d prefill graphs (tokens %s) in %.1fs",
                 self.rank, len(sizes), ",".join(map(str, sizes)), len(self.prefill_graphs),
                 ",".join(map(str, sorted(self.prefill_graphs))), time.perf_counter() - t0)


def _triton_fits(head_dim: int) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    half = head_dim // 2
    return head_dim >= 16 and head_dim % 2 == 0 and half & (half - 1) == 0


def _cpu_kernels():
    """The C++ CPU ops, or None where they cannot be built (the torch ops run instead)."""
    from neuron.kernels.cpu import KernelUnavailable, cpu_kernels

    try:
        return cpu_kernels()
    except KernelUnavailable as exc:
        log.warning("%s; the CPU step runs unfused torch ops", exc)
        return None
