"""The prefix cache's host tier in the leader's scheduler (``engine/host_tier.py``,
``engine/host_planning.py``), driven as test_prefix_cache drives the scheduler: a simulated rank
whose blocks and host slots hold tokens, which moves them as each step says (offloads first, then
restores, then the step's sequences). A block restored from the wrong slot, a slot overwritten
before its restore has read it, or a restored block cached before its restore ran would change
some continuation; so every workload must give what a scheduler without any cache gives."""

from __future__ import annotations

import asyncio

from hypothesis import example, given, settings, strategies as st

from neuron.engine.scheduler import Scheduler
from test_prefix_cache import VOCAB, Device, drive, request


class TieredDevice(Device):
    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.host: dict[tuple[int, int], int] = {}  # (slot, offset) -> token
        self.offloads = self.restores = 0
        self.beside_decodes: list[tuple[int, int]] = []  # steps with decodes: (moves, blocks the step writes)

    def step(self, plan, moves) -> list[int]:
        if moves is not None and any(x.start_pos >= len(x.req.prompt) for x in plan):
            written = {(x.req.slot, p // self.bs) for x in plan for p in range(x.start_pos, x.start_pos + len(x.tokens))}
            self.beside_decodes.append((len(moves.offload) + len(moves.restore), len(written)))
        if moves is not None:
            for block, slot in moves.offload:
                for o in range(self.bs):
                    self.host[(slot, o)] = self.cells.get((block, o), -7)
            for slot, block in moves.restore:
                for o in range(self.bs):
                    self.cells[(block, o)] = self.host[(slot, o)]
            self.offloads += len(moves.offload)
            self.restores += len(moves.restore)
        return self.run(plan)


def scheduler(blocks: int, block_size: int, host: int, per_step: int = 1 << 20, slots: int = 4) -> Scheduler:
    sched = Scheduler(max_slots=slots, max_len=256, num_blocks=blocks, block_size=block_size, max_batch_tokens=24,
                      prefill_chunk=8, cache_key=b"model" if host >= 0 else None)
    sched.use_host(max(host, 0), per_step)
    return sched


def serve(jobs, blocks: int, block_size: int, host: int, in_flight: int = 2, one_by_one: bool = True,
          per_step: int = 1 << 20, fail_at: int = -1):
    """Run the jobs (``one_by_one``: each after the last has ended); outputs, host tokens, the
    scheduler, the device. ``fail_at``: that step fails as a rank's failure does (its requests
    end, nothing it carried is taken)."""
    async def main():
        sched = scheduler(blocks, block_size, host, per_step)
        device = TieredDevice(block_size)
        reqs = [request(p, n) for p, n in jobs]
        steps = [0]

        def launch(plan):
            moves = sched.take_moves(plan)
            steps[0] += 1
            if steps[0] == fail_at:  # a failed step: its moves undone, its sequences' writes as they may be
                device.step(plan, None)
                return None
            return device.step(plan, moves)

        drive(sched, reqs, in_flight, one_by_one, launch,
              lambda plan, tokens: fail(sched, plan) if tokens is None else take(sched, plan, tokens))
        assert sched.blocks.used == 0
        return [r.output for r in reqs], [r.host_tokens for r in reqs], sched, device
    return asyncio.run(main())


def take(sched: Scheduler, plan, tokens: list[int], fetched=(), lost=()) -> None:
    sched.completed(plan, fetched, lost)
    for x, tok in zip(plan, tokens):
        if not x.sample:
            continue
        x.req.pending -= 1
        if x.req.finished or x.run != x.req.run:
            continue
        x.req.output.append(tok)
        if len(x.req.output) >= x.req.max_tokens:
            x.req.finished = True
            sched.release(x.req, keep=True)


def fail(sched: Scheduler, plan) -> None:
    """As the engine fails a step's requests on a rank's error."""
    sched.abandon(plan)
    for x in plan:
        if x.sample:
            x.req.pending -= 1
        x.req.finished = True
        x.req.output.append(-1)  # marks it failed: its output is not compared
        sched.release(x.req)


def test_a_prompt_evicted_from_the_rank_comes_back_from_the_host_tier_and_answers_the_same():
    long = [1 + i % (VOCAB - 1) for i in range(40)]
    others = [[2 + (i * 7 + j) % (VOCAB - 2) for j in range(40)] for i in range(3)]
    jobs = [(long, 4), *[(o, 4) for o in others], (long + [5, 6], 4)]
    reference, _, _, _ = serve(jobs, 4096, 4, host=-1)
    got, host_tokens, sched, device = serve(jobs, 14, 4, host=64)
    assert got == reference
    assert host_tokens[-1] == 40  # every full block of the long prompt, from the host tier
    assert device.offloads >= 10 and device.restores == 10
    assert sched.host.hits == 40 and sched.host.restored == 10


def test_without_a_host_tier_the_same_workload_recomputes_the_evicted_prompt():
    long = [1 + i % (VOCAB - 1) for i in range(40)]
    others = [[2 + (i * 7 + j) % (VOCAB - 2) for j in range(40)] for i in range(3)]
    jobs = [(long, 4), *[(o, 4) for o in others], (long + [5, 6], 4)]
    _, host_tokens, sched, device = serve(jobs, 14, 4, host=0)
    assert sched.host is None and host_tokens == [0] * 5 and device.offloads == 0


def test_restores_beside_decodes_go_a_few_blocks_a_step():
    long = [1 + i % (VOCAB - 1) for i in range(40)]
    filler = [[2 + (i * 5 + j) % (VOCAB - 2) for j in range(40)] for i in range(2)]
    # the long prompt, evicted by the fillers, returns while a long answer is decoding
    jobs = [(long, 2), *[(f, 2) for f in filler], ([3] * 6, 30), (long, 3)]
    reference, _, _, _ = serve(jobs, 4096, 4, host=-1, one_by_one=False)
    got, _, sched, device = serve(jobs, 30, 4, host=64, one_by_one=False, per_step=2)
    assert got == reference


def test_a_long_prompt_admitted_beside_a_decode_offloads_the_blocks_it_evicts_as_its_chunks_write_them():
    cached = [[2 + (i * 7 + j) % (VOCAB - 2) for j in range(40)] for i in range(3)]
    long = [1 + i % (VOCAB - 1) for i in range(100)]
    # three prompts cached (30 blocks), then a long answer decodes while a 100-token prompt takes
    # 25 new blocks, most of them the cached ones: their offloads go out 2 (its chunk) a step
    jobs = [*[(c, 1) for c in cached], ([3] * 6, 60), (long, 2), *[(c, 2) for c in cached]]
    reference, _, _, _ = serve(jobs, 4096, 4, host=-1, one_by_one=False)
    got, _, sched, device = serve(jobs, 40, 4, host=64, one_by_one=False, per_step=2)
    assert got == reference
    assert sched.host.offloaded >= 20 and sched.host.hits > 0
    assert max(moves - written for moves, written in device.beside_decodes) <= 2


@settings(max_examples=150, deadline=None)
# a preempted request, its output recomputed, comes back with host blocks restored one a step
# beside a decode: its last token waits for them all
@example(prefixes=[[1] * 13], picks=[(0, [], 1), (0, [], 7), (0, [1], 4)], blocks=12, host=2, block_size=2,
         in_flight=1, one_by_one=False, per_step=1)
# a block copied into the tier ahead of its eviction takes the slot a restore of the same step reads
@example(prefixes=[[1] * 5], picks=[(0, [], 1), (0, [], 8), (0, [1], 7), (0, [], 1), (0, [], 1), (0, [], 1)],
         blocks=12, host=2, block_size=2, in_flight=1, one_by_one=False, per_step=1)
# a block evicted for a prompt admitted beside a decode is offloaded no later than its chunk writes it
@example(prefixes=[[83, 48, 52, 40, 60, 77, 44, 69, 65, 22, 4, 19, 33, 88, 29, 73, 18, 15, 24, 53, 94, 80, 7, 13, 70,
                    88, 35, 92, 14, 27], [9, 81, 74, 68, 83, 11, 10, 28, 83, 23, 66, 56, 3]],
         picks=[(0, [], 1), (2, [], 4), (1, [], 1), (1, [89, 83], 1), (2, [], 1)], blocks=25, host=2, block_size=2,
         in_flight=1, one_by_one=False, per_step=1)
@given(
    prefixes=st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=5, max_size=30), min_size=1, max_size=3),
    picks=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, VOCAB - 1), max_size=6),
                             st.integers(1, 10)), min_size=1, max_size=10),
    blocks=st.integers(12, 30),
    host=st.integers(1, 12),
    block_size=st.sampled_from([2, 4]),
    in_flight=st.integers(1, 3),
    one_by_one=st.booleans(),
    per_step=st.integers(1, 4),
)
def test_a_small_cache_and_host_tier_under_heavy_sharing_give_what_no_cache_gives(
        prefixes, picks, blocks, host, block_size, in_flight, one_by_one, per_step):
    jobs = [(prefixes[i % len(prefixes)] + suffix, n) for i, suffix, n in picks]
    if any(len(p) + n > blocks * block_size - block_size for p, n in jobs):
        return  # a request that can never fit alone is refused at the door
    reference, _, _, _ = serve(jobs, 4096, block_size, host=-1)
    got, host_tokens, sched, _ = serve(jobs, blocks, block_size, host=host, in_flight=in_flight,
                                       one_by_one=one_by_one, per_step=per_step)
    assert got == reference
    assert sched.host.used <= host
    assert all(t % block_size == 0 and t < len(p) for t, (p, _) in zip(host_tokens, jobs))


@settings(max_examples=100, deadline=None)
@given(fail_at=st.integers(1, 60), in_flight=st.integers(1, 3), per_step=st.integers(1, 3))
def test_after_a_failed_step_the_tier_forgets_and_every_other_answer_stays_right(fail_at, in_flight, per_step):
    long = [1 + i % (VOCAB - 1) for i in range(40)]
    others = [[2 + (i * 7 + j) % (VOCAB - 2) for j in range(40)] for i in range(3)]
    # a long answer decodes throughout, so restores go out a few blocks a step
    jobs = [([3] * 6, 40), (long, 4), *[(o, 4) for o in others], (long + [5, 6], 4), (long, 3)]
    reference, _, _, _ = serve(jobs, 4096, 4, host=-1, one_by_one=False)
    got, _, sched, _ = serve(jobs, 20, 4, host=64, in_flight=in_flight, one_by_one=False, fail_at=fail_at,
                             per_step=per_step)
    failed = [i for i, out in enumerate(got) if -1 in out]
    assert len(failed) <= 4
    assert [out for i, out in enumerate(got) if i not in failed] == \
        [out for i, out in enumerate(reference) if i not in failed]


def test_the_blocks_waiting_to_be_copied_early_are_bounded_by_the_rank_s_cache():
    sched = scheduler(blocks=12, block_size=2, host=64, per_step=1)
    for i in range(100):
        sched.blocks.on_register[-1](i % 12, bytes([i]) * 16)
    assert len(sched.host._early) == 12
