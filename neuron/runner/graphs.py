"""The runner's CUDA graphs: one per decode batch-size bucket, and one per token bucket of prompt
steps (``PREFILL_GRAPH_TOKENS``), all in one memory pool. A step whose sequences are all
single-token decodes and fit a bucket replays that bucket's graph; a step with prompt chunks of up
to the largest token bucket replays a prefill graph, in which every sequence, decodes included,
is a span of the paged prefill kernel, so one graph per token bucket serves any mix. Their inputs
go up in one copy from a few pinned staging buffers."""

from __future__ import annotations

import logging
import time
import weakref

import torch

import protocol as p

from neuron.models.ops import StateSpans

from .attention import StepMeta
from .inputs import CHUNK, chunk_tables, flatten

log = logging.getLogger("neuron.runner")

# Token buckets of the prefill graphs. A 50-token step launches ~300 kernels eagerly, about 20 ms
# of host time around a few ms of device work.
PREFILL_GRAPH_TOKENS = (32, 64, 128, 192, 256, 320, 384, 512)
# Beyond them, buckets every PAST_STEP tokens up to a full batch of decodes and BESIDE_DECODES
# prompt tokens (the engine's ``step_budget.WHOLE``): at 512 streams new prompts come nearly every
# step, and each such step ran eagerly, 2 of 3 steps (NEURON_RANK_PROFILE, H200, Qwen3-8B shape).
BESIDE_DECODES = 192
PAST_STEP = 64


def prefill_graph_sizes(cfg) -> list[int]:
    """The token buckets of a runner config's prefill graphs: up to the longest prompt step
    (``max_len``) and up to a full decode batch with a prompt chunk beside it, within
    ``max_step_tokens``."""
    max_seqs, max_len, max_step_tokens = cfg.max_seqs, cfg.max_len, cfg.max_step_tokens
    need = min(max_step_tokens, max_seqs + BESIDE_DECODES)
    sizes = [n for n in PREFILL_GRAPH_TOKENS if n <= min(max_step_tokens, max(max_len, need))]
    n = PREFILL_GRAPH_TOKENS[-1]
    while n < need:
        n = min(n + PAST_STEP, need)
        sizes.append(n)
    return sizes


def graph_sizes(max_seqs: int) -> list[int]:
    sizes = [n for n in (1, 2, 4, 8) if n < max_seqs] + list(range(16, max_seqs, 16))
    return sorted(set(sizes + [max_seqs]))


class StepGraphs:
    def __init__(self, runner) -> None:
        # Weak: the runner holds these graphs, and a cycle would keep its KV cache and graphs
        # after an unload until the garbage collector ran (NCCL's teardown waits for the graphs).
        self._runner = weakref.ref(runner)
        self.decode: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.prefill: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, None]] = {}
        self.graph_in: torch.Tensor | None = None
        self._pg_rows = 0
        # A pipeline stage after the first: the previous stage's residual stream, received into
        # this static buffer before a replay (the sends and receives stay outside the graphs).
        self.hidden_in: torch.Tensor | None = None
        # A model with an MTP layer: each graph's final hidden states (its static output), the
        # model's ``hidden`` after a replay.
        self.hidden_out: dict[tuple[bool, int], torch.Tensor] = {}

    @property
    def runner(self):
        return self._runner()

    def clear(self) -> None:
        self.decode.clear()
        self.prefill.clear()
        self.hidden_out.clear()

    def _replayed(self, decode: bool, n: int) -> None:
        if self.hidden_out:
            self.runner.model.hidden = self.hidden_out[(decode, n)]

    # ----------------------------------------------------------------------------- decode
    def bucket(self, seqs: list[p.StepSeq]) -> int:
        if not self.decode or not seqs or any(len(s.tokens) != 1 for s in seqs):
            return 0
        return next((n for n in sorted(self.decode) if n >= len(seqs)), 0)

    def draft_bucket(self, seqs: list[p.StepSeq]) -> int:
        """The decode graph for a step of decodes with drafts (speculative decoding, a model
        without recurrent state): a row for each token, at its own position; 0 if none fits."""
        if not self.decode or any(len(s.tokens) != s.drafts + 1 or not s.sample for s in seqs):
            return 0
        rows = sum(len(s.tokens) for s in seqs)
        return next((n for n in sorted(self.decode) if n >= rows), 0)

    def replay(self, seqs: list[p.StepSeq], bucket: int, drafts: bool = False):
        assert self.graph_in is not None
        staged = self._staging()
        packed = staged.numpy()
        packed[:4] = 0
        packed[2] = self.runner.scratch_row
        packed[6] = self.runner.states.scratch
        B = len(seqs)
        if not drafts:
            for i, s in enumerate(seqs):
                packed[0, i], packed[1, i], packed[2, i], packed[3, i] = s.tokens[0], s.start_pos, s.slot, s.sample
                packed[6, i] = s.state
        else:  # a row per token and draft; the verdict, not the graph's argmax, draws the next token
            B = 0  # (the rows of one slot would race to store theirs)
            for s in seqs:
                for j, token in enumerate(s.tokens):
                    packed[:4, B] = token, s.start_pos + j, s.slot, s.sample and not s.drafts
                    packed[6, B] = s.state
                    B += 1
        self.graph_in.copy_(staged, non_blocking=True)
        graph, ids, logits, argmax = self.decode[bucket]
        stage = self.runner.stage
        if stage is None:
            graph.replay()
            self._replayed(True, bucket)
            return ids[:B], self.graph_in[1, :B], self.graph_in[2, :B], logits[:B], argmax[:B]
        import torch.distributed as dist

        t = self.runner.rank % stage.tensor
        if not stage.first:
            dist.recv(self.hidden_in[:bucket], src=stage.peer(-1, t))
        graph.replay()
        if not stage.last:  # ``logits`` is this stage's residual stream
            dist.send(logits, dst=stage.peer(1, t))
            return ids[:B], self.graph_in[1, :B], self.graph_in[2, :B], None, None
        return ids[:B], self.graph_in[1, :B], self.graph_in[2, :B], logits[:B], argmax[:B]

    def _staging(self) -> torch.Tensor:
        """The next of a few pinned buffers for the graphs' inputs: a fresh pinned allocation per
        step costs more than the step's whole launch. At most two steps are in flight, so a buffer
        is reused only after the copy that read it has run."""
        self._stage = (self._stage + 1) % len(self._staged)
        return self._staged[self._stage]

    def _decode_forward(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The captured decode step of ``n`` rows over the static inputs (token, position, slot,
        whether the row is sampled, and the recurrent layers' spans: row, 1, state slot; a row
        each): its token ids, logits and their argmax,
        which the step also stores as the sampled rows' last draws (greedy sampling then launches
        nothing after the graph)."""
        from neuron.kernels.gpu import decode_splits, greedy_tokens

        r = self.runner
        assert self.graph_in is not None
        ids, pos, slots = self.graph_in[0, :n], self.graph_in[1, :n], self.graph_in[2, :n]
        ids = r.resolve(ids, slots)
        shape = r.model.attention_shape
        heads = shape.n_kv if shape.gqa_repeat else shape.n_q
        # The kernels find each row's cache row and context from its slot and position.
        r.attention.meta = StepMeta(
            store_index=None, decode_rows=None, decode_slots=slots, decode_ctx=None,
            decode_max_ctx=r.cfg.max_len, decode_splits=decode_splits(n, heads, r.cfg.max_len, r.sm_count),
            state_spans=StateSpans([], self.graph_in[4:7, :n], 1) if r.states.slots else None)
        if r.stage is None:
            logits = r.model.forward(ids, pos, r.attention, None)
        else:
            hidden = None if r.stage.first else self.hidden_in[:n]
            logits = r.model.forward(ids, pos, r.attention, None, hidden)
            if not r.stage.last:
                return ids, logits, None
        return ids, logits, greedy_tokens(logits, slots, self.graph_in[3, :n], r.sampler.last_token)

    # ----------------------------------------------------------------------------- prefill
    def prefill_bucket(self, seqs: list[p.StepSeq]) -> int:
        if not self.prefill or len(seqs) > self.runner.cfg.max_seqs:
            return 0
        if sum(len(s.snapshots) for s in seqs) > self._pg_snaps:  # the graphs' table holds this many
            return 0
        if sum(s.drafts + 1 for s in seqs if s.sample) > self._pg_rows:
            return 0
        T = sum(len(s.tokens) for s in seqs)
        return next((n for n in sorted(self.prefill) if n >= T), 0)

    def replay_prefill(self, seqs: list[p.StepSeq], sampled: list[int], bucket: int):
        """A step of prompt chunks (and decodes beside them) through the prefill graph of
        ``bucket`` tokens: its inputs go up in one copy; padding rows write the scratch block."""
        r = self.runner
        ids, positions, slot_of, store, _, _, ends = flatten(seqs, r.tables_host, r.bs)
        T = len(ids)
        self._pstage = (self._pstage + 1) % len(self._pstaged)
        staged = self._pstaged[self._pstage]
        whole = self._pg_layout(staged.numpy(), self._pg_tokens)
        for name, values, pad in (("ids", ids, 0), ("pos", positions, 0), ("slot", slot_of, r.scratch_row),
                                  ("store", store, r.kv.scratch * r.bs)):
            whole[name][:T] = values
            whole[name][T:] = pad
        whole["spans"][:] = 0
        for i, (s, end) in enumerate(zip(seqs, ends)):
            whole["spans"][i] = (end + 1 - len(s.tokens), len(s.tokens), s.slot, s.start_pos)
        if r.states.slots:
            spans = [(end + 1 - len(s.tokens), len(s.tokens), s.state) for s, end in zip(seqs, ends)]
            spans += [(0, 0, r.states.scratch)] * (r.cfg.max_seqs - len(seqs))
            snaps = [(i, at - s.start_pos, slot) for i, s in enumerate(seqs) for at, slot in s.snapshots]
            whole["states"][:], whole["chunks"][:], whole["conv_snaps"][:] = chunk_tables(
                spans, snaps, self._pg_chunks, self._pg_snaps)
        shape = r.attention.shape
        size = self._work_size(bucket)
        single = [len(s.tokens) == 1 for s in seqs]
        whole["work"][:size] = r.attention.kernels.prefill_work([0 if one else len(s.tokens) for s, one in
                                                                 zip(seqs, single)], shape.gqa_repeat, shape.head_dim,
                                                                r.device, size)
        decodes = whole["decodes"]
        decodes[:] = ((0,), (bucket,), (r.scratch_row,), (1,))  # padding: the spare output row
        picked = [(end, s.slot, s.start_pos + 1) for s, end, one in zip(seqs, ends, single) if one]
        if picked:
            decodes[0, : len(picked)], decodes[2, : len(picked)], decodes[3, : len(picked)] = zip(*picked)
            decodes[1, : len(picked)] = decodes[0, : len(picked)]
        rows = [r for i in sampled for r in range(ends[i] - seqs[i].drafts, ends[i] + 1)]  # drafts: each's row
        whole["rows"][:] = 0
        whole["rows"][: len(rows)] = rows
        self._pg_in.copy_(staged, non_blocking=True)
        graph, resolved, logits, _ = self.prefill[bucket]
        graph.replay()
        self._replayed(False, bucket)
        view = self._pg_layout(self._pg_in, T)
        return resolved[:T], view["pos"], view["slot"], logits[: len(rows)]

    def _pg_layout(self, buf, n: int) -> dict:
        """The prefill graphs' inputs in one int64 buffer (the device's, or a host staging copy):
        the first ``n`` of each token row's (ids, positions, slots, cache rows), the sequences'
        spans [max_seqs, 4], the rows to sample [max_seqs, or the rows of a step with drafts], and
        the recurrent layers' tables (``inputs.chunk_tables``): spans [5, max_seqs], chunks and
        conv snapshots."""
        Tmax, S, C, M = self._pg_tokens, self.runner.cfg.max_seqs, self._pg_chunks, self._pg_snaps
        at = 4 * Tmax + 4 * S + self._pg_rows
        return {"ids": buf[:n], "pos": buf[Tmax: Tmax + n], "slot": buf[2 * Tmax: 2 * Tmax + n],
                "store": buf[3 * Tmax: 3 * Tmax + n], "spans": buf[4 * Tmax: 4 * Tmax + 4 * S].reshape(S, 4),
                "rows": buf[4 * Tmax + 4 * S: at], "states": buf[at: at + 5 * S].reshape(5, S),
                "chunks": buf[at + 5 * S: at + 5 * S + 3 * C].reshape(3, C),
                "conv_snaps": buf[at + 5 * S + 3 * C: at + 5 * S + 3 * C + 4 * M].reshape(4, M),
                "work": buf[at + 5 * S + 3 * C + 4 * M: at + 5 * S + 3 * C + 4 * M + self._work_size(Tmax)],
                "decodes": buf[at + 5 * S + 3 * C + 4 * M + self._work_size(Tmax):
                               at + 9 * S + 3 * C + 4 * M + self._work_size(Tmax)].reshape(4, S)}

    def _pg_size(self) -> int:
        return 4 * self._pg_tokens + 9 * self.runner.cfg.max_seqs + self._pg_rows + 3 * self._pg_chunks \
            + 4 * self._pg_snaps + self._work_size(self._pg_tokens) + 4 * self.runner.cfg.max_seqs

    def _work_size(self, n: int) -> int:
        """The attention work list's items in the prefill graph of ``n`` tokens."""
        r = self.runner
        shape = r.attention.shape
        return r.attention.kernels.prefill_work_size(n, r.cfg.max_seqs, shape.gqa_repeat, shape.head_dim, r.device)

    def _prefill_forward(self, n: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The captured prefill step of ``n`` token rows over the static inputs."""
        r = self.runner
        v = self._pg_layout(self._pg_in, n)
        ids = r.resolve(v["ids"], v["slot"])
        # Small steps split each tile's keys (prefill_splits): a question after a long cached
        # prefix is a few query tiles over thousands of keys, too few programs to keep the device
        # busy. Its one-token chunks (decodes) go through the decode kernel: as chunks of the
        # prefill kernel, a tile of 128 (query, head) rows held 4, one program to an SM.
        D = min(r.cfg.max_seqs, n)
        rows, places, tables, ctx = v["decodes"][:, :D]
        shape = r.attention.shape
        splits = r.attention.kernels.decode_splits(D, shape.n_kv if shape.gqa_repeat else shape.n_q, r.cfg.max_len,
                                                   r.sm_count)
        r.attention.meta = StepMeta(store_index=v["store"], decode_rows=rows, decode_out=places,
                                    decode_slots=tables, decode_ctx=ctx.to(torch.int32), decode_max_ctx=r.cfg.max_len,
                                    decode_splits=splits,
                                    prefill_spans=v["spans"].to(torch.int32), prefill_max_n=n,
                                    prefill_splits=r.attention.kernels.prefill_splits(
                                        n, shape.gqa_repeat, shape.n_q, shape.head_dim, r.sm_count, r.device),
                                    prefill_work=v["work"][: self._work_size(n)],
                                    state_spans=StateSpans([], v["states"], n, [], v["chunks"], v["conv_snaps"])
                                    if r.states.slots else None)
        return ids, r.model.forward(ids, v["pos"], r.attention, v["rows"]), None

    # ----------------------------------------------------------------------------- capture
    def _capture_prefill(self, pool) -> None:
        cfg, r = self.runner.cfg, self.runner
        sizes = prefill_graph_sizes(cfg)
        if not sizes:
            return
        Tmax, S = sizes[-1], cfg.max_seqs
        self._pg_tokens = Tmax
        # Room for two snapshots a sequence (and one a draft), and every chunk they and the
        # sequences' ends cut. Drafts are checked in these graphs beside prompt chunks, and
        # always for a model with recurrent state.
        self._pg_rows = max(S, r.cfg.draft_rows)
        self._pg_snaps = 2 * S + r.cfg.draft_rows if r.states.slots else 0
        self._pg_chunks = -(-Tmax // CHUNK) + S + self._pg_snaps if r.states.slots else 0
        self._pg_in = torch.zeros(self._pg_size(), dtype=torch.int64, device=r.device)
        whole = self._pg_layout(self._pg_in, Tmax)  # captured with every row padding
        whole["slot"].fill_(r.scratch_row)
        whole["store"].fill_(r.kv.scratch * r.bs)
        whole["states"][2].fill_(r.states.scratch)
        whole["conv_snaps"][3].fill_(-1)
        whole["chunks"][2].fill_(-1)
        whole["decodes"][2].fill_(r.scratch_row)
        whole["decodes"][3].fill_(1)
        self._pstaged = [torch.zeros(self._pg_size(), dtype=torch.int64).pin_memory() for _ in range(4)]
        self._pstage = 0
        self._capture_each(sizes, self._prefill_forward, self.prefill, pool)

    def _capture_each(self, sizes: list[int], forward, into: dict, pool):
        """One graph of ``forward(n)`` per size into ``into``, largest first, all in one memory
        pool; returns the pool."""
        device = self.runner.device
        for n in reversed(sizes):
            forward(n)  # compiles the kernels and settles the allocator before capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                ids, logits, argmax = forward(n)
            pool = graph.pool()
            into[n] = (graph, ids, logits, argmax)
            if getattr(self.runner.model, "mtp", None) is not None:
                self.hidden_out[(into is self.decode, n)] = self.runner.model.hidden
        return pool

    def capture(self) -> None:
        r = self.runner
        t0 = time.perf_counter()
        sizes = graph_sizes(r.decode_rows)
        self.graph_in = torch.zeros(7, sizes[-1], dtype=torch.int64, device=r.device)
        self.graph_in[2].fill_(r.scratch_row)
        self.graph_in[4] = torch.arange(sizes[-1], device=r.device)  # the recurrent layers' spans: a row each
        self.graph_in[5].fill_(1)
        self.graph_in[6].fill_(r.states.scratch)
        self._staged = [torch.zeros(7, sizes[-1], dtype=torch.int64).pin_memory() for _ in range(4)]
        for staged in self._staged:
            staged[4:7] = self.graph_in[4:7].cpu()
        self._stage = 0
        if r.stage is not None and not r.stage.first:
            self.hidden_in = torch.zeros(sizes[-1], r.model.cfg.hidden_size, dtype=r.model.dtype, device=r.device)
        pool = self._capture_each(sizes, self._decode_forward, self.decode, None)
        if r.stage is None:  # pipeline stages run their prompt steps eagerly
            self._capture_prefill(pool)
        torch.cuda.synchronize(r.device)
        log.info("rank %d: captured %d decode graphs (batch %s) and %d prefill graphs (tokens %s) in %.1fs",
                 r.rank, len(sizes), ",".join(map(str, sizes)), len(self.prefill),
                 ",".join(map(str, sorted(self.prefill))), time.perf_counter() - t0)
