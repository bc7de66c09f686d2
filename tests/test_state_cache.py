"""The prefix cache of a model with recurrent state, in the leader's scheduler and state cache,
against a simulated device that keeps both kinds of state: the K/V cells its sequences' tables
name, and in each state slot the tokens the slot's sequence has consumed (copied by snapshots and
restores as the rank copies them). A sequence's next token is a function of both, so a snapshot
taken at the wrong point, a wrong restore, a reused slot or a partial block copied wrong would
change some continuation: every workload must give what the scheduler without a cache gives, and
when everything has ended no slot is held or lost."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections import deque

from hypothesis import given, settings, strategies as st

from neuron.engine.scheduler import DEVICE_TOKEN, Scheduler
from test_prefix_cache import VOCAB, request, run_alone, take_tokens


def next_token(context: list[int], state: tuple[int, ...]) -> int:
    return 1 + hashlib.blake2b(bytes(str((context, state)), "ascii"), digest_size=4).digest()[0] % (VOCAB - 1)


class Device:
    def __init__(self, block_size: int, slots: int) -> None:
        self.bs = block_size
        self.cells: dict[tuple[int, int], int] = {}
        self.tables: dict[int, list[int]] = {}
        self.last: dict[int, int] = {}
        self.state: list[tuple[int, ...]] = [()] * slots

    def run(self, plan) -> list[int]:
        out = []
        for x in plan:
            slot, s = x.req.slot, x.req.states[0]
            table = self.tables.setdefault(slot, [])
            if x.start:
                table.clear()
                self.state[s] = self.state[x.state_from] if x.state_from >= 0 else ()
            del table[x.block_start:]
            table.extend(x.blocks)
            if x.kv_from >= 0:  # the cached partial block: this sequence's own block starts as a copy
                for o in range(x.start_pos % self.bs):
                    self.cells[(table[x.start_pos // self.bs], o)] = self.cells[(x.kv_from, o)]
            snaps = dict(x.snapshots)
            for i, tok in enumerate(x.tokens):
                pos = x.start_pos + i
                tok = self.last[slot] if tok == DEVICE_TOKEN else tok
                self.cells[(table[pos // self.bs], pos % self.bs)] = tok
                self.state[s] = self.state[s] + (tok,)
                if pos + 1 in snaps:
                    self.state[snaps[pos + 1]] = self.state[s]
            if x.sample:
                end = x.start_pos + len(x.tokens)
                context = [self.cells[(table[p // self.bs], p % self.bs)] for p in range(end)]
                self.last[slot] = next_token(context, self.state[s])
            out.append(self.last[slot] if x.sample else -1)
        return out


def serve(jobs, blocks: int, block_size: int, caching: bool, snapshots: int, in_flight: int, seed: int,
          fail: float = 0.0):
    """Run the jobs to the end (arriving a few at a time); outputs, cached tokens, scheduler.
    ``fail``: the chance that a step fails (its requests end, as the engine ends them)."""
    async def main():
        slots = 3
        sched = Scheduler(max_slots=slots, max_len=256, num_blocks=blocks, block_size=block_size,
                          max_batch_tokens=24, prefill_chunk=8, cache_key=b"model" if caching else None,
                          state_slots=slots + snapshots, state_snapshots=snapshots, snapshot_interval=2 * block_size)
        device = Device(block_size, slots + snapshots)
        reqs = run_jobs(sched, device.run, jobs, in_flight, seed, fail)
        return [r.output for r in reqs], [r.cached_tokens for r in reqs], sched
    return asyncio.run(main())


def run_jobs(sched: Scheduler, launch, jobs, in_flight: int, seed: int, fail: float = 0.0) -> list:
    """The jobs' requests, run to the end (arriving a few at a time, ``in_flight`` steps out):
    ``launch(plan)`` runs a step on the simulated device. A failed step's requests end with -1
    (their outputs are not compared). Then no slot may be held or lost."""
    rng = random.Random(seed)
    reqs = [request(p, n) for p, n in jobs]
    pending = deque(reqs)
    queue: deque = deque()
    while pending or not sched.idle or queue:
        if pending and rng.random() < 0.5:
            sched.waiting.append(pending.popleft())
        sched.admit()
        while len(queue) < in_flight:
            plan = sched.schedule()
            if not plan:
                break
            queue.append((plan, launch(plan)))
        if not queue:
            assert pending, "nothing can run: the scheduler is stuck"
            continue
        plan, tokens = queue.popleft()
        if rng.random() < fail:
            sched.abandon(plan)
            for x in plan:
                x.req.pending -= x.sample
                if not x.req.finished:
                    x.req.finished = True
                    x.req.output.append(-1)
                    sched.release(x.req)
            continue
        take_tokens(sched, plan, tokens, keep=True)
    states = sched.states
    assert sched.blocks.used == sum(1 for s in states._lru if s.block >= 0)  # only snapshots' tail blocks
    assert states.running == 0 and states.pending == 0 and not sched.closing
    held = [s.slot for s in states._lru]
    assert len(set(held)) == len(held) and len(states._free) + len(held) == states.num_slots
    assert not set(held) & set(states._free)
    return reqs


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    prefixes=st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=3, max_size=30), min_size=1, max_size=3),
    picks=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, VOCAB - 1), max_size=6),
                             st.integers(1, 10)), min_size=1, max_size=10),
    blocks=st.integers(14, 30),
    block_size=st.sampled_from([2, 4]),
    snapshots=st.integers(0, 6),
    in_flight=st.integers(1, 3),
    seed=st.integers(0, 3),
)
def test_snapshots_and_restores_give_what_no_cache_gives(prefixes, picks, blocks, block_size, snapshots, in_flight,
                                                         seed):
    jobs = [(prefixes[i % len(prefixes)] + suffix, n) for i, suffix, n in picks]
    if any(len(p) + n > blocks * block_size - 2 * block_size for p, n in jobs):
        return  # a request that can never fit alone is refused at the door
    reference, _, _ = serve(jobs, 4096, block_size, False, 0, 1, seed)
    got, cached, _ = serve(jobs, blocks, block_size, True, snapshots, in_flight, seed)
    assert got == reference
    assert all(c < len(p) for c, (p, _) in zip(cached, jobs))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 1000), in_flight=st.integers(1, 3))
def test_failed_steps_and_preemptions_lose_no_slot(seed, in_flight):
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(13)]
    jobs = [(system + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 9))], rng.randrange(1, 12))
            for _ in range(12)]
    serve(jobs, 20, 4, True, 4, in_flight, seed, fail=0.15)  # its own checks: no slot held or lost


def test_a_chat_restarts_each_turn_at_the_end_of_the_last():
    """Each turn is the last turn's prompt, its answer and a question: it starts from the last
    turn's own slot, kept as a snapshot with its partial block, at the very end of that turn."""
    async def main():
        sched = Scheduler(max_slots=2, max_len=256, num_blocks=64, block_size=4, max_batch_tokens=24,
                          prefill_chunk=8, cache_key=b"m", state_slots=6, state_snapshots=4, snapshot_interval=8)
        device = Device(4, 6)
        prompt = list(range(1, 12))
        found = []
        for turn in range(4):
            req = request(prompt, 5)
            run_alone(sched, device, req, keep=True)
            found.append((req.cached_tokens, len(req.prompt) + len(req.output)))
            prompt = req.prompt + req.output + [20 + turn, 30 + turn]
        return found
    found = asyncio.run(main())
    for (hit, _), (_, before) in zip(found[1:], found):
        assert hit >= before - 1  # all of the last turn but its last token, partial block included
