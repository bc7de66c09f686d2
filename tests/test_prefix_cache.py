"""Automatic prefix caching in the leader's block manager and scheduler.

The property test drives the real Scheduler with a simulated device: every step writes its
tokens into the blocks its sequences' tables name, and a sequence's next token is a function of
the whole context it reads back through its table. Wrong sharing, a reused block still in use,
or a read of a freed block would change some continuation; so every workload must give exactly
what a scheduler without a prefix cache (and with room for everything) gives.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque

from hypothesis import given, settings, strategies as st

from neuron.engine.blocks import BlockManager
from neuron.engine.request import GenRequest
from neuron.engine.scheduler import DEVICE_TOKEN, Scheduler
from protocol import Sampling

VOCAB = 97


def request(prompt: list[int], max_tokens: int) -> GenRequest:
    return GenRequest(prompt=list(prompt), sampling=Sampling(temperature=0.0), max_tokens=max_tokens,
                      stop_token_ids=frozenset())


def next_token(context: list[int]) -> int:
    return 1 + hashlib.blake2b(bytes(str(context), "ascii"), digest_size=4).digest()[0] % (VOCAB - 1)


class Device:
    """The rank, as far as the leader's bookkeeping can tell: tables, blocks, last draws."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.cells: dict[tuple[int, int], int] = {}  # (block, offset) -> token
        self.tables: dict[int, list[int]] = {}
        self.last: dict[int, int] = {}

    def run(self, plan) -> list[int]:
        out = []
        for x in plan:
            slot = x.req.slot
            table = self.tables.setdefault(slot, [])
            if x.start:
                table.clear()
            del table[x.block_start:]
            table.extend(x.blocks)
            for i, tok in enumerate(x.tokens):
                pos = x.start_pos + i
                tok = self.last[slot] if tok == DEVICE_TOKEN else tok
                self.cells[(table[pos // self.bs], pos % self.bs)] = tok
            if x.sample:
                end = x.start_pos + len(x.tokens)
                context = [self.cells[(table[p // self.bs], p % self.bs)] for p in range(end)]
                self.last[slot] = next_token(context)
            out.append(self.last[slot] if x.sample else -1)
        return out


def serve(jobs: list[tuple[list[int], int]], blocks: int, block_size: int, caching: bool, in_flight: int = 2,
          one_by_one: bool = False) -> tuple[list[list[int]], list[int], Scheduler]:
    """Run the jobs to the end (all at once, or each after the last); outputs, cached tokens."""
    async def main():
        sched = Scheduler(max_slots=4, max_len=256, num_blocks=blocks, block_size=block_size, max_batch_tokens=24,
                          prefill_chunk=8, cache_key=b"model" if caching else None)
        device = Device(block_size)
        reqs = [request(p, n) for p, n in jobs]
        drive(sched, reqs, in_flight, one_by_one, device.run, lambda plan, tokens: take_tokens(sched, plan, tokens))
        assert sched.blocks.used == 0
        return [r.output for r in reqs], [r.cached_tokens for r in reqs], sched
    return asyncio.run(main())


def drive(sched: Scheduler, reqs: list[GenRequest], in_flight: int, one_by_one: bool, launch, land,
          idle_work=lambda: False) -> None:
    """Feed ``reqs`` to ``sched`` (all at once, or each after the last has ended) and run its steps
    to the end, ``in_flight`` of them out at a time: ``launch(plan)`` runs a step on the simulated
    rank, ``land(plan, what launch gave)`` takes its reply, oldest first. ``idle_work()``: whether
    a step with no sequences goes out when nothing else can (the disk tier's moves and news)."""
    pending = deque(reqs)
    queue: deque = deque()
    steps = 0
    while pending or not sched.idle or queue or idle_work():
        steps += 1
        assert steps < 100_000, "the scheduler never settles"
        if pending and (not one_by_one or sched.idle and not queue):
            sched.waiting.append(pending.popleft())
            if not one_by_one:
                continue
        sched.admit()
        while len(queue) < in_flight:
            plan = sched.schedule()
            if not plan and (queue or not idle_work()):
                break
            queue.append((plan, launch(plan)))
        assert queue, "nothing can run: the scheduler is stuck"
        land(*queue.popleft())


def run_alone(sched: Scheduler, device, req: GenRequest, keep: bool = False) -> None:
    """Admit ``req`` into an idle scheduler and run it to its end, one step at a time (``keep``:
    its end as a finished request's, whose last state a model with state keeps)."""
    sched.waiting.append(req)
    sched.admit()
    while not req.finished:
        plan = sched.schedule()
        take_tokens(sched, plan, device.run(plan), keep)


def take_tokens(sched: Scheduler, plan, tokens: list[int], keep: bool = False) -> None:
    """A completed step's tokens into its requests, as the engine takes them: a request that
    reaches its max_tokens ends (``keep``: as a finished request whose last state is kept)."""
    sched.completed(plan)
    for x, tok in zip(plan, tokens):
        if not x.sample:
            continue
        x.req.pending -= 1
        if x.req.finished:
            continue
        x.req.output.append(tok)
        if len(x.req.output) >= x.req.max_tokens:
            x.req.finished = True
            sched.release(x.req, keep=keep)


def test_chain_hashes_name_the_whole_prefix_and_the_key():
    a = BlockManager(8, 4, b"model-a")
    blocks = a.allocate(2)
    from neuron.engine.blocks import chain_hash
    h1 = chain_hash(b"", [1, 2, 3, 4], b"model-a")
    h2 = chain_hash(h1, [5, 6, 7, 8], b"model-a")
    a.register(blocks[0], h1)
    a.register(blocks[1], h2)
    assert a.match([1, 2, 3, 4, 5, 6, 7, 8, 9], 8)[0] == blocks
    assert a.match([1, 2, 3, 4, 5, 6, 7, 9, 9], 8)[0] == blocks[:1]  # the second block differs
    assert a.match([0, 2, 3, 4, 5, 6, 7, 8, 9], 8)[0] == []  # so does the first: nothing after it counts
    assert a.match([1, 2, 3, 4, 5, 6, 7, 8], 7)[0] == blocks[:1]  # at most `limit` tokens
    assert chain_hash(b"", [1, 2, 3, 4], b"model-b") != h1


def test_an_unused_cached_block_stays_findable_until_its_memory_is_needed():
    bm = BlockManager(3, 2, b"m")
    from neuron.engine.blocks import chain_hash
    table = bm.allocate(1)
    h = chain_hash(b"", [7, 7], b"m")
    bm.register(table[0], h)
    block = table[0]
    bm.release(table)
    assert bm.free_count == 3 and bm.match([7, 7, 1], 2)[0] == [block]
    bm.allocate(2)  # the two never-used blocks go first
    assert bm.match([7, 7, 1], 2)[0] == [block]
    bm.allocate(1)  # now the cached one is evicted
    assert bm.match([7, 7, 1], 2)[0] == []


def test_requests_sharing_a_system_prompt_reuse_its_blocks_and_count_them_exactly():
    system = list(range(1, 42))  # 41 tokens: 10 whole blocks of 4
    jobs = [(system + [50 + i, 60 + i], 5) for i in range(4)]
    reference, _, _ = serve(jobs, 400, 4, caching=False)
    outputs, cached, sched = serve(jobs, 400, 4, caching=True, one_by_one=True)
    assert outputs == reference
    assert cached == [0, 40, 40, 40]
    assert sched.blocks.hits == 120 and sched.blocks.queries == 4 * 42


def test_a_multi_turn_conversation_takes_each_earlier_turn_from_the_cache():
    async def main():
        sched = Scheduler(max_slots=2, max_len=512, num_blocks=64, block_size=4, max_batch_tokens=64,
                          prefill_chunk=32, cache_key=b"m")
        device = Device(4)
        history: list[int] = [3, 1, 4, 1, 5, 9, 2, 6, 5]
        cached = []
        for turn in range(4):
            req = request(history + [10 + turn], 6)
            run_alone(sched, device, req)
            cached.append(req.cached_tokens)
            history = req.prompt + req.output
        return cached
    cached = asyncio.run(main())
    # each turn finds every whole block of the previous turn's prompt and answer but the last token
    assert cached[0] == 0 and all(c >= prev for prev, c in zip(cached, cached[1:])) and cached[-1] >= 24


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    prefixes=st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=5, max_size=30), min_size=1, max_size=3),
    picks=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, VOCAB - 1), max_size=6),
                             st.integers(1, 10)), min_size=1, max_size=10),
    blocks=st.integers(12, 30),
    block_size=st.sampled_from([2, 4]),
    in_flight=st.integers(1, 3),
)
def test_a_small_cache_under_heavy_sharing_gives_what_no_cache_gives(prefixes, picks, blocks, block_size, in_flight):
    jobs = [(prefixes[i % len(prefixes)] + suffix, n) for i, suffix, n in picks]
    if any(len(p) + n > blocks * block_size - block_size for p, n in jobs):
        return  # a request that can never fit alone is refused at the door
    reference, _, _ = serve(jobs, 4096, block_size, caching=False)
    got, cached, sched = serve(jobs, blocks, block_size, caching=True, in_flight=in_flight)
    assert got == reference
    assert all(c % block_size == 0 and c < len(p) for c, (p, _) in zip(cached, jobs))


def test_requests_with_different_cache_salts_share_nothing():
    async def main():
        sched = Scheduler(max_slots=2, max_len=256, num_blocks=64, block_size=4, max_batch_tokens=64,
                          prefill_chunk=32, cache_key=b"m")
        device = Device(4)
        prompt = list(range(1, 30))
        found = []
        for salt in (b"alice", b"bob", b"alice"):
            req = request(prompt, 2)
            req.cache_salt = salt
            run_alone(sched, device, req)
            found.append(req.cached_tokens)
        return found
    assert asyncio.run(main()) == [0, 0, 28]


def test_a_prompt_waiting_for_room_hashes_its_blocks_once(monkeypatch):
    """A prompt whose first 40 tokens are cached waits at the head of the queue for blocks while
    another request runs, and is matched again at every step: each of its blocks is hashed once
    (its hashes kept with it, ``GenRequest.chain``), not at every attempt (99 hashes before)."""
    import neuron.engine.blocks as blocks_mod

    calls = []
    real = blocks_mod.chain_hash
    monkeypatch.setattr(blocks_mod, "chain_hash", lambda *a: calls.append(1) or real(*a))

    async def main():
        sched = Scheduler(max_slots=4, max_len=256, num_blocks=24, block_size=4, max_batch_tokens=24,
                          prefill_chunk=8, cache_key=b"model")
        device = Device(4)
        prefix = [1 + i % 90 for i in range(40)]
        run_alone(sched, device, request(prefix, 1))
        sched.waiting.append(request([50 + i % 40 for i in range(40)], 4))  # holds 10-11 blocks while it runs
        sched.admit()
        back = request(prefix + [3] * 20, 1)
        sched.waiting.append(back)
        calls.clear()
        attempts = 0
        while not back.finished:
            attempts += back.slot < 0
            sched.admit()
            plan = sched.schedule()
            take_tokens(sched, plan, device.run(plan))
        return attempts, back.cached_tokens
    attempts, cached = asyncio.run(main())
    assert attempts >= 8 and cached == 40  # it waited, and found its prefix
    assert len(calls) <= 20  # its 15 blocks and the other's last, once each
