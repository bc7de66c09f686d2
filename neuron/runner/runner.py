"""The rank's model runner: everything between a ``step`` frame and the device.

It owns the caches the model's layers declare (``state_specs``): the paged KV cache of its
attention layers and the per-sequence state of its recurrent ones, sized from the device memory
left after the weights (``sizing``); the block tables the leader fills; the device sampler; and
on CUDA the fused kernels and the CUDA graphs (``graphs``). A step's sequences are checked and
flattened into rows (``inputs``); steps that fit a graph replay it, longer steps and the CPU run
eagerly: there the device's work outweighs the host's launches.

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
from neuron.models.interface import KvState, Model

from .attention import PagedAttention, PagedKvCache
from .graphs import StepGraphs, graph_sizes, prefill_graph_sizes
from .host_tier import MoveTimes, carries_moves, host_tier
from .images import RankImages
from .eager import eager_inputs
from .late_masks import LateMasks, row_masks
from .inputs import DEVICE_TOKEN, StepRejected, check_step
from .mtp import MtpDrafting
from .ops import cpu_kernels_or_none, triton_fits
from .sampler import DeviceSampler, upload
from .speculative import verify_drafts
from .sizing import kv_blocks, state_snapshots
from .state import StatePool

log = logging.getLogger("neuron.runner")

__all__ = ["DEVICE_TOKEN", "ModelRunner", "PendingStep", "RunnerConfig", "StepRejected"]


@dataclass
class RunnerConfig:
    max_seqs: int
    max_len: int
    block_size: int = 16
    kv_tokens: int = 0  # 0: as many as the device memory allows (CUDA only)
    memory_fraction: float = 0.9
    max_step_tokens: int = 2048
    cuda_graphs: bool = True
    state_dtype: torch.dtype = torch.float32  # of recurrent state that accumulates (RecurrentState)
    state_snapshots: int = 0  # state slots beyond one per sequence, for snapshots; -1: by memory
    draft_rows: int = 0  # the most rows (decodes and drafts) a step with drafts carries: its graphs
    host_bytes: int = 0  # the host tier of the prefix cache (host_tier.py); 0: none
    disk: tuple = ()  # (directory, bytes, model, identity) of the disk tier below it; (): none
    collective_s: float = 60.0  # how long a CPU rank waits for the others in a collective


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
    drafts: list[list[int]] | None = None  # each sampled row's drafts (speculative decoding)
    proposals: list[list[int]] | None = None  # each seq's drafts from the MTP layer (StepSeq.propose)
    mask_wait_ms: float = 0.0  # of host_ms, waiting for late masks
    moves: MoveTimes | None = None  # the host tier's moves at the step's start

    def wait(self) -> tuple[list[int], list[list[tuple[int, float]]] | None, p.StepTimings,
                            list[list[int]] | None]:
        if self.ready is not None:
            # Poll rather than block in the driver: the device thread must keep the GIL's turn to
            # launch the next step while this one runs.
            while not self.ready.query():
                time.sleep(20e-6)
        device_ms = (time.perf_counter() - self.started) * 1e3
        idle_ms = self.gap[0].elapsed_time(self.gap[1]) if self.gap is not None else 0.0
        tokens = [-1] * self.n_seqs
        drawn = self.tokens.tolist()
        for seq, tok in zip(self.rows, drawn):
            tokens[seq] = tok
        drafted = None
        if self.drafts is not None:
            drafted = [[] for _ in range(self.n_seqs)]
            for seq, d, n in zip(self.rows, self.drafts, drawn[len(self.rows):]):
                drafted[seq] = d[:n]
        logprobs = None
        if self.logprobs is not None:
            chosen, values, ids = (t.tolist() for t in self.logprobs)
            logprobs = [[] for _ in range(self.n_seqs)]
            for r, (seq, n) in enumerate(zip(self.rows, self.want)):
                if n:
                    top = list(zip(ids[r][: n - 1], values[r][: n - 1]))
                    logprobs[seq] = [(tokens[seq], chosen[r]), *top]
        offload_ms, restore_ms = self.moves.ms() if self.moves is not None else (0.0, 0.0)
        return (tokens, logprobs, p.StepTimings(forward_ms=device_ms, host_ms=self.host_ms, idle_ms=idle_ms,
                                                mask_wait_ms=self.mask_wait_ms, offload_ms=offload_ms,
                                                restore_ms=restore_ms), drafted)


class ModelRunner:
    def __init__(self, model: Model, cfg: RunnerConfig, rank: int) -> None:
        self.model, self.cfg, self.rank = model, cfg, rank
        # Pipeline stages hand the residual stream on; the last stage's tensor rank 0 samples.
        self.stage = getattr(model, "stage", None)
        self.samples = rank == (self.stage.sampler if self.stage is not None else 0)
        self.device = model.device
        self.cuda = self.device.type == "cuda"
        self.vocab = model.cfg.vocab_size
        self.bs = cfg.block_size
        self.max_blocks = -(-cfg.max_len // self.bs)
        self.scratch_row = cfg.max_seqs  # the table row of padded graph rows
        shape = model.attention_shape
        self.triton = self.cuda and triton_fits(shape.head_dim)
        if self.triton:
            from neuron.models.tp_linear import has_packed
            from neuron.kernels.gpu import pdl_by_default

            from .ops import TritonOps
            model.ops = TritonOps(model.ops, int8_rows=has_packed(model))
            pdl_by_default(model.comm.world == 1)
            self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.cpu_kernels = cpu_kernels_or_none() if self.device.type == "cpu" and model.dtype == torch.float32 else None
        if self.cpu_kernels is not None:
            from .ops import CpuOps
            model.ops = CpuOps(model.ops, self.cpu_kernels)
        specs = model.state_specs()
        kv_layers = sum(isinstance(s, KvState) for s in specs)
        # The decode graphs' rows: a step's decodes, or (without recurrent state) its decodes and
        # their drafts; a model with recurrent state checks drafts in the prefill graphs.
        self.decode_rows = cfg.max_seqs if len(specs) > kv_layers else max(cfg.max_seqs, cfg.draft_rows)
        self.state_snapshots = state_snapshots(self, specs)
        # With drafts, a slot for the state after each draft but the last (speculative decoding).
        scratch = max(0, cfg.draft_rows - 1) if len(specs) > kv_layers else 0
        self.states = StatePool(specs, cfg.max_seqs + self.state_snapshots + scratch, self.device, cfg.state_dtype)
        blocks = kv_blocks(self, kv_layers, self.states.nbytes)
        self.kv = PagedKvCache(kv_layers, blocks, self.bs, shape.n_kv, shape.head_dim, self.device, model.dtype)
        self.host = host_tier(self.kv, cfg.host_bytes, self.states, rank, cfg.disk)
        self.tables_host = np.full((cfg.max_seqs + 1, self.max_blocks), self.kv.scratch, dtype=np.int32)
        self.tables = torch.from_numpy(self.tables_host).to(self.device)
        self.assigned = [0] * cfg.max_seqs  # table entries the leader has filled, per slot
        # decode rows: a token and its drafts for each sequence (speculative decoding)
        self.attention = PagedAttention(self.kv, self.tables, shape, self.triton,
                                        (cfg.max_seqs + 1) * (p.MAX_DRAFTS + 1), self.cpu_kernels,
                                        model.ops.int8_rows if self.triton else 0, self.states)
        self.sampler = DeviceSampler(cfg.max_seqs + 1, self.vocab, self.device)
        self.stage_tokens = None
        if self.stage is not None and self.stage.count > 1:
            from .pipeline import StageTokens
            self.stage_tokens = StageTokens(self.stage, rank, self.sampler.last_token)
        self.step_graphs = StepGraphs(self)
        self.mtp = MtpDrafting(self) if getattr(model, "mtp", None) is not None else None
        self.images = RankImages(model, self.device) if getattr(model, "vision", None) is not None else None
        self._last_end: torch.cuda.Event | None = None
        self._waited_ms = 0.0  # the step's wait for its late masks
        if self.cuda:
            self._outs = [torch.zeros(cfg.max_seqs, dtype=torch.int64).pin_memory() for _ in range(4)]
            self._out = 0
        if self.cuda and model.comm.world > 1:
            rows = max(graph_sizes(self.decode_rows) + prefill_graph_sizes(cfg))
            how = model.comm.use_peer_memory(rows, model.cfg.hidden_size, model.dtype, self.device, model.ops)
            log.info("rank %d: all-reduces of up to %d rows: %s", rank, rows, how)
        if not self.cuda and model.comm.world > 1:
            kernels = self.cpu_kernels or cpu_kernels_or_none()
            log.info("rank %d: collectives: %s", rank, model.comm.use_host_memory(kernels and kernels.mod, cfg.collective_s))
        if self.cuda and cfg.cuda_graphs and model.capturable and self.triton:
            from .linear import tune_all
            tune_all(model, graph_sizes(self.decode_rows), rank)
            try:
                self.step_graphs.capture()
            except RuntimeError as exc:  # e.g. a collective the driver cannot capture: run eagerly
                log.warning("rank %d: CUDA graph capture failed, decode steps run eagerly: %s", rank, exc)
                self.step_graphs.clear()
                torch.cuda.synchronize(self.device)

    @property
    def kv_blocks(self) -> int:
        return self.kv.blocks

    @property
    def graphs(self) -> list[int]:
        """The decode batch sizes captured as CUDA graphs."""
        return sorted(self.step_graphs.decode)

    # ----------------------------------------------------------------------------- a step
    def step(self, msg: p.Step, late: LateMasks | None = None) -> PendingStep | None:
        """Launch one step; the sampling rank returns what to wait for, the others None.
        ``late``: where the masks of its ``mask_later`` rows come in."""
        t0 = time.perf_counter()
        gap = None
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            gap = (self._last_end, begin) if self._last_end is not None else None
        seqs = msg.seqs
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        drafting = any(s.drafts for s in seqs)
        proposing = self.mtp is not None and any(s.propose for s in seqs)
        accepted = None
        self._waited_ms = 0.0
        moves = None
        if carries_moves(msg):
            if self.host is None:
                raise StepRejected("a step moves KV blocks to or from a host tier this rank does not have")
            moves = self.host.step_moves(msg)
        if not seqs:  # moves only; with nothing to move or with reads begun, a short wait for the disk's news
            if self.host is not None and (moves is None or msg.fetch):
                self.host.wait_for_disk(0.002)
            done = moves.marks[-1] if moves is not None and moves.cuda else None
            return PendingStep(0, [], [], torch.zeros(0, dtype=torch.int64), None, done, t0, 0.0, moves=moves) \
                if self.samples else None
        if self.stage_tokens is not None:
            self.stage_tokens.before_step([s.slot for s in seqs if s.tokens and s.tokens[0] < 0])
        bucket, ids, positions, slot_t, logits, argmax = self._forward(seqs, sampled)
        if self.images is not None:  # after the step's own images: it may drop one it just encoded
            self.images.forget(msg.forget_images)
        rows_slots = [seqs[i].slot for i in sampled]
        every_token_sampled = bucket and len(sampled) == len(seqs)  # then token rows are sampled rows
        slot_rows = slot_t if every_token_sampled else upload(rows_slots, torch.int64, self.device)
        if self.samples and self.sampler.penalised([s.slot for s in seqs]):
            self.sampler.feed(slot_t, ids, positions)
        if not sampled:
            tokens, logprobs = torch.zeros(0, dtype=torch.int64, device=self.device), None
        elif self.samples and drafting:
            tokens, accepted, logprobs = verify_drafts(self, seqs, sampled, logits)
        elif self.samples:
            last = [seqs[i].start_pos + len(seqs[i].tokens) - 1 for i in sampled]
            tokens, logprobs = self.sampler.sample(logits, rows_slots, slot_rows, last,
                                                   self._row_masks(msg.step_id, [seqs[i] for i in sampled], late),
                                                   argmax if every_token_sampled else None)
        else:
            tokens, logprobs = torch.empty(len(sampled), dtype=torch.int64, device=self.device), None
        if sampled and self.stage_tokens is not None:
            self.stage_tokens.after_step(tokens, rows_slots)
        elif sampled and self.model.comm.world > 1:
            if proposing and drafting:  # every rank's MTP layer runs on the drafts kept
                if accepted is None:
                    accepted = torch.empty_like(tokens)
                both = torch.cat([tokens, accepted])
                self.model.comm.broadcast(both)
                tokens, accepted = both[: len(sampled)], both[len(sampled):]
            else:
                self.model.comm.broadcast(tokens)
            if not self.samples:
                self.sampler.last_token[slot_rows] = tokens
        proposals = self.mtp.after_step(seqs, ids, tokens, accepted) if proposing else None
        if not self.samples:
            return None
        want = [self.sampler.params[s].logprobs for s in rows_slots]
        ready = None
        if accepted is not None:  # one copy to the host: the tokens, then the counts
            tokens = torch.cat([tokens, accepted])
        if self.cuda:
            tokens = self._to_host(tokens)
            if logprobs is not None:
                logprobs = tuple(t.to("cpu", non_blocking=True) for t in logprobs)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
            self._last_end = ready
        return PendingStep(len(seqs), sampled, want, tokens, logprobs, ready, t0,
                           (time.perf_counter() - t0) * 1e3, gap,
                           [list(seqs[i].tokens[len(seqs[i].tokens) - seqs[i].drafts:]) if seqs[i].drafts else []
                            for i in sampled] if drafting else None, proposals, self._waited_ms, moves)

    def _row_masks(self, step_id: int, sampled: list[p.StepSeq], late: LateMasks | None) -> list[bytes | None]:
        try:
            masks, self._waited_ms = row_masks(step_id, sampled, late, self.vocab)
        except ValueError as exc:
            raise StepRejected(str(exc)) from None
        return masks

    def forward_logits(self, seqs: list[p.StepSeq], every_position: bool = False) -> torch.Tensor:
        """The logits of a step without sampling (parity checks): [sampled seqs, V], or with
        ``every_position`` [tokens, V] (run eagerly)."""
        return self._forward(seqs, [i for i, s in enumerate(seqs) if s.sample], every_position)[-2]

    def _forward(self, seqs: list[p.StepSeq], sampled: list[int], every_position: bool = False):
        check_step(self, seqs)
        self._update_tables(seqs)
        for s in seqs:
            if s.sampling is not None:
                self.sampler.start(s.slot, s.sampling)
                if s.context and self.samples and self.sampler.penalised([s.slot]):
                    n = len(s.context)
                    at = upload([[s.slot] * n, s.context, list(range(n))], torch.int64, self.device)
                    self.sampler.feed(at[0], at[1], at[2])
        if any(s.images for s in seqs) and self.images is None:
            raise StepRejected("a step holds images, and this model takes none")
        if self.images is not None:
            for s in seqs:
                if s.sampling is not None:
                    self.images.start(s)
            if self.images.involved(seqs):  # the embeddings and M-RoPE tables are the step's own
                return (0, *self._eager(seqs, sampled, every_position), None)
        if any(s.drafts for s in seqs) and not every_position:  # every draft's logits: a row each
            rows = 0 if self.states.slots else self.step_graphs.draft_bucket(seqs)
            if rows:
                ids, positions, slot_t, logits, _ = self.step_graphs.replay(seqs, rows, drafts=True)
                return 0, ids, positions, slot_t, logits, None
            tokens = self.step_graphs.prefill_bucket(seqs)
            if tokens:
                return (0, *self.step_graphs.replay_prefill(seqs, sampled, tokens), None)
            return (0, *self._eager(seqs, sampled, every_position), None)
        bucket = 0 if every_position else self.step_graphs.bucket(seqs)
        if not bucket:
            tokens = 0 if every_position else self.step_graphs.prefill_bucket(seqs)
            if tokens:
                return (0, *self.step_graphs.replay_prefill(seqs, sampled, tokens), None)
            return (0, *self._eager(seqs, sampled, every_position), None)
        ids, positions, slot_t, logits, argmax = self.step_graphs.replay(seqs, bucket)
        if logits is not None and len(sampled) < len(seqs):
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

    def _update_tables(self, seqs: list[p.StepSeq]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        if self.states.slots:
            self.states.clear([s.state for s in seqs if s.sampling is not None and s.state_from == -1])
            restored = [s for s in seqs if s.sampling is not None and s.state_from not in (-1, s.state)]
            self.states.copy([s.state_from for s in restored], [s.state for s in restored])
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
        copies = [(s.kv_from, int(self.tables_host[s.slot, s.start_pos // self.bs])) for s in seqs if s.kv_from != -1]
        if copies:  # a cached partial block: the sequence's own block starts as a copy of it
            self.kv.copy_blocks(upload(list(zip(*copies)), torch.int64, self.device))

    # ----------------------------------------------------------------------------- eager
    def _eager(self, seqs: list[p.StepSeq], sampled: list[int], every_position: bool = False):
        ids_t, pos_t, slot_t, meta, ends, positions = eager_inputs(self, seqs)
        T = len(positions)
        ids_t = self.resolve(ids_t, slot_t)
        if self.images is not None and self.images.involved(seqs):
            meta.images = self.images.step_inputs(seqs, positions)
        self.attention.meta = meta
        # A step that samples nothing (a prompt chunk that is not the last) still computes one row.
        rows = upload(list(range(T)) if every_position else
                      [r for i in sampled for r in range(ends[i] - seqs[i].drafts, ends[i] + 1)] or [T - 1],
                      torch.int64, self.device)
        if self.stage is None or self.stage.count == 1:
            return ids_t, pos_t, slot_t, self.model.forward(ids_t, pos_t, self.attention, rows)
        return ids_t, pos_t, slot_t, self._stage_forward(ids_t, pos_t, rows)

    def _stage_forward(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """This stage's layers over the step: from the previous stage's residual stream (from
        the rank of the same tensor rank there), to the next stage's; the last stage's logits."""
        import torch.distributed as dist

        st, t = self.stage, self.rank % self.stage.tensor
        hidden = None
        if not st.first:
            hidden = torch.empty(len(ids), self.model.cfg.hidden_size, dtype=self.model.dtype, device=self.device)
            dist.recv(hidden, src=st.peer(-1, t))
        out = self.model.forward(ids, positions, self.attention, rows, hidden)
        if st.last:
            return out
        dist.send(out.contiguous(), dst=st.peer(1, t))
        return None

    def resolve(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Device tokens (-1) become the slot's last draw, still on the device."""
        if self.triton:
            from neuron.kernels.gpu import resolve_tokens
            return resolve_tokens(ids, slots, self.sampler.last_token)
        return torch.where(ids >= 0, ids, self.sampler.last_token[slots])

