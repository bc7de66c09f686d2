"""A hybrid model's prefix cache with a host tier (``engine/host_tier.py``, ``host_planning.py``):
the ranks' state snapshots leave for host slots, a few pieces a slot, when the ranks evict them,
and come back into a request's own state slot; K/V blocks go and come as for any model. Driven
against test_state_cache's simulated device, which here also keeps host slots and moves them as
each step says (offloads first, then restores, then the step's sequences). A piece restored from
the wrong slot, a slot reused before its snapshot was copied out, or a prompt that runs before its
state is whole would change some continuation: every workload must give what a scheduler
without any cache gives, and nothing is left held."""

from __future__ import annotations

import asyncio
import random

from hypothesis import example, given, settings, strategies as st

from neuron.engine.blocks import chain_hash
from neuron.engine.scheduler import Scheduler
from neuron.engine.tier_moves import state_keys
from test_host_tier import take as take_step
from test_disk_tier import Files
from test_prefix_cache import VOCAB, drive, request
from test_state_cache import Device, run_jobs


class TieredDevice(Device):
    def __init__(self, block_size: int, slots: int, pieces: int) -> None:
        super().__init__(block_size, slots)
        self.pieces = pieces
        self.host: dict[int, tuple] = {}
        self.coming: dict[int, dict[int, tuple]] = {}  # state slot -> the pieces restored so far
        self.state_moves = [0, 0]

    def step(self, plan, moves) -> list[int]:
        if moves is not None:
            for block, slot in moves.offload:
                self.host[slot] = ("kv", tuple(self.cells.get((block, o), -7) for o in range(self.bs)))
            for state_slot, j, slot in moves.state_offload:
                self.host[slot] = ("state", j, self.state[state_slot])
            for slot, block in moves.restore:
                kind, cells = self.host[slot]
                assert kind == "kv", f"host slot {slot} holds a state's piece, not a block"
                for o, tok in enumerate(cells):
                    self.cells[(block, o)] = tok
            for slot, state_slot, j in moves.state_restore:
                kind, piece, value = self.host[slot]
                assert kind == "state" and piece == j, f"host slot {slot} does not hold piece {j}"
                got = self.coming.setdefault(state_slot, {})
                got[j] = value
                if len(got) == self.pieces:  # whole: the slot holds it (pieces that differ: garbage)
                    self.state[state_slot] = value if len(set(got.values())) == 1 else (-9,)
                    del self.coming[state_slot]
            self.state_moves[0] += len(moves.state_offload)
            self.state_moves[1] += len(moves.state_restore)
        return self.run(plan)


def serve(jobs, blocks: int, block_size: int, host: int, snapshots: int, pieces: int, in_flight: int, seed: int,
          fail: float = 0.0):
    """Run the jobs to the end (arriving a few at a time); outputs, cached tokens, scheduler,
    device. ``host``: host slots (-1: no prefix cache at all)."""
    async def main():
        slots = 3
        sched = Scheduler(max_slots=slots, max_len=256, num_blocks=blocks, block_size=block_size,
                          max_batch_tokens=24, prefill_chunk=8, cache_key=b"model" if host >= 0 else None,
                          state_slots=slots + snapshots, state_snapshots=snapshots, snapshot_interval=2 * block_size)
        sched.use_host(max(host, 0), 3, state_pieces=pieces)
        device = TieredDevice(block_size, slots + snapshots, pieces)
        reqs = run_jobs(sched, lambda plan: device.step(plan, sched.take_moves(plan)), jobs, in_flight, seed, fail)
        if sched.host is not None:
            assert not sched.host.pool.pins and not sched._restores
        return [r.output for r in reqs], [r.cached_tokens for r in reqs], sched, device
    return asyncio.run(main())


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    prefixes=st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=3, max_size=40), min_size=1, max_size=3),
    picks=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, VOCAB - 1), max_size=6),
                             st.integers(1, 10)), min_size=1, max_size=12),
    blocks=st.integers(14, 30),
    block_size=st.sampled_from([2, 4]),
    snapshots=st.integers(1, 4),
    host=st.integers(4, 40),
    pieces=st.integers(1, 3),
    in_flight=st.integers(1, 3),
    seed=st.integers(0, 3),
)
def test_snapshots_through_the_host_tier_give_what_no_cache_gives(prefixes, picks, blocks, block_size, snapshots,
                                                                   host, pieces, in_flight, seed):
    jobs = [(prefixes[i % len(prefixes)] + suffix, n) for i, suffix, n in picks]
    if any(len(p) + n > blocks * block_size - 2 * block_size for p, n in jobs):
        return  # a request that can never fit alone is refused at the door
    reference, _, _, _ = serve(jobs, 4096, block_size, -1, 1, pieces, 1, seed)
    got, cached, _, _ = serve(jobs, blocks, block_size, host, snapshots, pieces, in_flight, seed)
    assert got == reference
    assert all(c < len(p) for c, (p, _) in zip(cached, jobs))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 1000), in_flight=st.integers(1, 3), pieces=st.integers(1, 3))
def test_failed_steps_through_the_tier_lose_no_slot_and_answer_right(seed, in_flight, pieces):
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(21)]
    jobs = [(system + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 9))], rng.randrange(1, 12))
            for _ in range(12)]
    reference, _, _, _ = serve(jobs, 4096, 4, -1, 1, pieces, 1, seed)
    got, _, _, _ = serve(jobs, 20, 4, 24, 2, pieces, in_flight, seed, fail=0.15)
    assert [g for g in got if -1 not in g] == [r for r, g in zip(reference, got) if -1 not in g]


def test_a_prompt_whose_snapshot_left_the_ranks_restarts_from_the_host_tier():
    """One snapshot slot: the long prompt's snapshots are evicted by the others' and go to the host
    tier; the long prompt again restarts at its last full block from there, with the cold answer."""
    long = [1 + i % (VOCAB - 1) for i in range(40)]
    others = [[2 + (i * 7 + j) % (VOCAB - 2) for j in range(40)] for i in range(3)]
    jobs = [(long, 4), *[(o, 4) for o in others], (long + [5, 6], 4)]
    reference, _, _, _ = serve(jobs, 4096, 4, -1, 1, 2, 1, 0)
    got, cached, sched, device = serve(jobs, 30, 4, 200, 1, 2, 1, 0)
    assert got == reference
    assert cached[-1] == 40  # all of it, its last token's block included: 40 is a block boundary
    assert sched.host.states_offloaded >= 3 and sched.host.states_restored >= 1
    assert device.state_moves[1] >= 2  # both pieces of the one restored
    alone, cached_alone, _, _ = serve(jobs, 30, 4, 0, 1, 2, 1, 0)
    assert alone == reference and cached_alone[-1] < 40  # without the tier: recomputed


class DiskDevice(TieredDevice):
    """Below the host slots, files (test_disk_tier's)."""

    def __init__(self, block_size: int, slots: int, pieces: int, disk: dict, delay: int, damaged: set) -> None:
        super().__init__(block_size, slots, pieces)
        self.files = Files(disk, delay, damaged)

    def step(self, plan, moves):
        fetched, lost = [], []
        for h, slot, data in self.files.land():
            if data is None:
                lost.append(h)
            else:
                self.host[slot] = data
                fetched.append(h)
        if moves is not None:
            self.files.before(moves, self.host.__getitem__,
                              [*(s for s, _ in moves.restore), *(s for s, _, _ in moves.state_restore),
                               *(s for _, s in moves.offload), *(s for _, _, s in moves.state_offload)])
        tokens = super().step(plan, moves)
        if moves is not None:
            self.files.after(moves)
        return tokens, fetched, lost


def run_disk(jobs, disk: dict, blocks: int, host: int, disk_files: int, pieces: int, delay: int, damaged: set,
             in_flight: int):
    """Each job after the last has ended, the disk tier written out while idle; ``disk`` carries over
    between runs as the files do across a restart."""
    async def main():
        slots, snapshots, bs = 3, 2, 4
        sched = Scheduler(max_slots=slots, max_len=256, num_blocks=blocks, block_size=bs, max_batch_tokens=24,
                          prefill_chunk=8, cache_key=b"model" if host else None, state_slots=slots + snapshots,
                          state_snapshots=snapshots, snapshot_interval=2 * bs)
        sched.use_host(host, 3, disk_files, list(disk), state_pieces=pieces)
        device = DiskDevice(bs, slots + snapshots, pieces, disk, delay, set(damaged))
        reqs = [request(p, n) for p, n in jobs]
        drive(sched, reqs, in_flight, True, lambda plan: device.step(plan, sched.take_moves(plan)),
              lambda plan, out: take_step(sched, plan, *out), sched.disk_waits)
        assert sched.states.running == 0 and (sched.host is None or not sched.host.fetching)
        return [r.output for r in reqs], [r.cached_tokens for r in reqs], sched
    return asyncio.run(main())


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    picks=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, VOCAB - 1), max_size=5),
                             st.integers(1, 6)), min_size=2, max_size=8),
    blocks=st.integers(16, 24),
    host=st.integers(8, 24),
    disk_files=st.integers(4, 60),
    pieces=st.integers(1, 3),
    delay=st.integers(0, 3),
    damage=st.integers(0, 5),
    in_flight=st.integers(1, 2),
)
# Found by many more random examples than the suite runs: a ranks' snapshot evicted into the tier
# while a request was being admitted took a slot the request had just found (its restore then
# read a state piece); a restart point needing more slots than the tier has, with a shallower one
# that fits, was not restored at all.
@example(picks=[(1, [], 1), (0, [], 1), (2, [], 4), (1, [], 1)], blocks=17, host=8, disk_files=21, pieces=1, delay=0,
         damage=0, in_flight=1)
@example(picks=[(0, [1], 1), (0, [], 1)], blocks=16, host=8, disk_files=13, pieces=1, delay=0, damage=0, in_flight=2)
def test_snapshots_through_host_and_disk_and_a_restart_give_what_no_cache_gives(picks, blocks, host, disk_files,
                                                                                 pieces, delay, damage, in_flight):
    prefixes = [[1 + (i * 7 + j * 3) % (VOCAB - 1) for j in range(30)] for i in range(3)]
    jobs = [(prefixes[i] + suffix, n) for i, suffix, n in picks]
    reference, _, _ = run_disk(jobs, {}, 4096, 0, 0, pieces, 0, set(), 1)
    disk: dict = {}
    got, _, _ = run_disk(jobs, disk, blocks, host, disk_files, pieces, delay, set(), in_flight)
    assert got == reference
    damaged = set(list(disk)[::damage]) if damage else set()  # some files damaged while it was down
    staged = not damaged and staged_from_disk(disk, jobs[0][0], pieces, host)
    again, cached, sched = run_disk(jobs, disk, blocks, host, disk_files, pieces, delay, damaged, in_flight)
    assert again == reference
    if staged:
        assert cached[0] > 0 and sched.host.states_restored > 0  # the first job restarts from the disk


def staged_from_disk(disk: dict, prompt: list[int], pieces: int, host: int, bs: int = 4) -> bool:
    """Whether the files of ``disk`` give ``prompt`` a restart point the host tier can stage: its
    run of full blocks on disk, the deepest snapshot along it on disk too, both in ``host`` slots."""
    run, parent = [], b""
    for i in range((len(prompt) - 1) // bs):
        parent = chain_hash(parent, prompt[i * bs: (i + 1) * bs], b"model")
        if parent not in disk:
            break
        run.append(parent)
    deepest = next((d for d in range(len(run), 0, -1) if all(k in disk for k in state_keys(run[d - 1], pieces))), 0)
    return deepest > 0 and deepest + pieces <= host



class OneByOne:
    """A scheduler (its host tier ``host`` slots; -1: no cache at all) on the tiered device, each
    job it is given run to its end before the next arrives."""

    def __init__(self, blocks: int, host: int, snapshots: int, pieces: int, block_size: int = 4) -> None:
        slots = 3
        self.sched = Scheduler(max_slots=slots, max_len=256, num_blocks=blocks, block_size=block_size,
                               max_batch_tokens=24, prefill_chunk=8, cache_key=b"model" if host >= 0 else None,
                               state_slots=slots + snapshots, state_snapshots=snapshots,
                               snapshot_interval=2 * block_size)
        self.sched.use_host(max(host, 0), 3, state_pieces=pieces)
        self.device = TieredDevice(block_size, slots + snapshots, pieces)

    def __call__(self, job):
        sched = self.sched
        return run_jobs(sched, lambda plan: self.device.step(plan, sched.take_moves(plan)), [job], 1, 0)[0]


def one_by_one(jobs, blocks: int, host: int, snapshots: int, pieces: int, block_size: int = 4):
    """The jobs one at a time, each to its end before the next arrives; outputs, cached tokens."""
    async def main():
        serve = OneByOne(blocks, host, snapshots, pieces, block_size)
        reqs = [serve(job) for job in jobs]
        return [r.output for r in reqs], [r.cached_tokens for r in reqs]
    return asyncio.run(main())


def chats(n: int, rounds: int, blocks: int, host: int, snapshots: int) -> list[list[int]]:
    """``n`` chats of one 16-token system prompt and 24 tokens of their own, one at a time, then
    ``rounds`` times each back in turn as a chat client sends it (the whole chat so far, its
    answer included, and a new message): each round of returns' cached tokens, the answers
    checked against a scheduler without any cache."""
    rng = random.Random(5)
    system = [rng.randrange(1, VOCAB) for _ in range(16)]
    prompts = [system + [rng.randrange(1, VOCAB) for _ in range(24)] for _ in range(n)]

    async def main(prompts):
        plain, cached = OneByOne(4096, -1, 1, 2), OneByOne(blocks, host, snapshots, 2)
        hits = []
        for r in range(rounds + 1):
            want = [plain((p, 4)).output for p in prompts]
            got = [cached((p, 4)) for p in prompts]
            assert [g.output for g in got] == want
            hits.append([g.cached_tokens for g in got])
            prompts = [p + w + [7 + r, 8, 9, 10] for p, w in zip(prompts, want)]
        return hits[1:]
    return asyncio.run(main(prompts))


def test_snapshots_a_chat_passed_leave_the_tier_first():
    """Six chats, each keeping snapshots every 8 tokens of its history. The host tier (80 slots)
    holds every chat's blocks and last snapshot, not also the ones each passed on its way: those
    go first, and every chat comes back to the whole of its first turn (least recently used first,
    every chat restarted at the end of the system prompt; passing only the snapshots a chat kept
    inside its prompt, the third to fifth did)."""
    assert chats(6, 1, 30, 80, 2) == [[43] * 6]


def test_a_chat_passes_the_snapshot_it_started_from():
    """No host tier, six snapshot slots, four chats of four turns: each turn starts at the end of
    the last one's answer and keeps its own prompt's last block and answer's end past it. The
    snapshot it started from and the one at its prompt's last block are passed, so the ranks hold
    each chat's latest end and every turn finds its whole history (passing only the snapshots a
    chat kept inside its prompt, or none, every turn restarted at the end of the system prompt)."""
    assert chats(4, 3, 4096, 0, 6) == [[43] * 4, [51] * 4, [59] * 4]


def test_a_system_prompt_s_snapshot_outlives_while_chats_restart_past_it():
    """Six chats of four turns, the tier too small for their last turns: a turn that cannot have
    its whole history still restarts at the end of the system prompt. Restarts past it keep its
    snapshot as recently used as themselves (without, the chats that found their whole history
    for two turns let it age out, and four of the last turns started from nothing)."""
    rounds = chats(6, 3, 30, 80, 2)
    assert rounds[:2] == [[43] * 6, [51] * 6]
    assert min(rounds[2]) == 16


def test_a_system_prompt_s_deepest_snapshot_outlives_those_passed_before_it():
    """Three snapshot slots: a first session passes the snapshots inside its 40-token system prompt
    on its way; the first passed go first, so a second session with the same system prompt still
    restarts at its end (evicting the most recently passed first, it restarted at 16)."""
    rng = random.Random(7)
    system = [rng.randrange(1, VOCAB) for _ in range(40)]
    jobs = [(system + [rng.randrange(1, VOCAB) for _ in range(16)], 4) for _ in range(2)]
    reference, _ = one_by_one(jobs, 4096, -1, 1, 2)
    got, cached = one_by_one(jobs, 4096, 0, 3, 2)
    assert got == reference
    assert cached == [0, 40]
