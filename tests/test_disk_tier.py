"""The prefix cache's disk tier in the leader's scheduler (``engine/host_tier.py``,
``engine/host_planning.py``), driven as test_host_tier drives the host tier: a simulated rank whose
blocks, host slots and disk files hold tokens, which moves them as each step says (deletions and
writes to disk first, then offloads and restores, then the step's sequences; reads from disk land in
their host slots a few steps later and are reported then, or fail for a damaged file). A restore
from a slot whose read has not landed, a slot written out after it was reused, or a damaged block
served would change some continuation; so every workload, also one run again by a "restarted"
scheduler over the same disk, must give what a scheduler without any cache gives."""

from __future__ import annotations

import asyncio
from collections import deque

from hypothesis import given, settings, strategies as st

from neuron.engine.scheduler import Scheduler
from test_host_tier import TieredDevice, take
from test_prefix_cache import VOCAB, drive, request


class Files:
    """The ranks' disk tier, simulated: files written and deleted as the steps say, read back into
    host slots ``delay`` steps after a fetch (a damaged or missing file is reported lost); a slot
    is never moved while its read fills it."""

    def __init__(self, disk: dict, delay: int, damaged: set) -> None:
        self.disk, self.delay, self.damaged = disk, delay, damaged
        self.reading: deque = deque()  # (steps left, hash, slot)
        self.unread: set[int] = set()  # slots whose read has not landed

    def land(self) -> list[tuple[bytes, int, object]]:
        """The reads due now: (hash, slot, what the file holds, or None: lost)."""
        self.reading = deque((left - 1, h, slot) for left, h, slot in self.reading)
        landed = []
        while self.reading and self.reading[0][0] <= 0:
            _, h, slot = self.reading.popleft()
            self.unread.discard(slot)
            if h in self.damaged or h not in self.disk:
                self.disk.pop(h, None)
                landed.append((h, slot, None))
            else:
                landed.append((h, slot, self.disk[h]))
        return landed

    def before(self, moves, slot_data, moved: list[int]) -> None:
        """A step's deletions and writes (``slot_data(slot)``: what a slot holds), before its moves
        of the ``moved`` slots."""
        for h in moves.drop:
            self.disk.pop(h, None)
        for slot, h in moves.spill:
            assert slot not in self.unread, "a slot written out before its read landed"
            self.disk[h] = slot_data(slot)
            self.damaged.discard(h)
        assert not self.unread.intersection(moved), "a slot moved while its read fills it"

    def after(self, moves) -> None:
        for h, slot in moves.fetch:
            self.reading.append((self.delay, h, slot))
            self.unread.add(slot)


class DiskDevice(TieredDevice):
    def __init__(self, block_size: int, disk: dict, delay: int, damaged: set) -> None:
        super().__init__(block_size)
        self.files = Files(disk, delay, damaged)
        self.reads = 0

    def step(self, plan, moves):
        fetched, lost = [], []
        for h, slot, data in self.files.land():
            if data is None:
                lost.append(h)
                continue
            for o in range(self.bs):
                self.host[(slot, o)] = data[o]
            fetched.append(h)
            self.reads += 1
        if moves is not None:
            self.files.before(moves, lambda slot: [self.host[(slot, o)] for o in range(self.bs)],
                              [*(s for s, _ in moves.restore), *(s for _, s in moves.offload)])
        tokens = super().step(plan, moves)
        if moves is not None:
            self.files.after(moves)
        return tokens, fetched, lost


def run(jobs, disk: dict, *, blocks: int = 14, block_size: int = 4, host: int = 12, disk_blocks: int = 64,
        delay: int = 1, damaged: set = frozenset(), in_flight: int = 2, one_by_one: bool = True,
        rates: tuple = ()):
    """Outputs, the scheduler and the device; ``disk`` (hash -> tokens) carries over between runs
    as the files do across a restart; ``rates``: the disk's blocks and the prompts' tokens a second,
    as if measured (``tier_choice.py``)."""
    async def main():
        sched = Scheduler(max_slots=4, max_len=256, num_blocks=blocks, block_size=block_size, max_batch_tokens=24,
                          prefill_chunk=8, cache_key=b"model")
        sched.use_host(host, 2, disk_blocks, list(disk))
        if rates:  # as if measured, and probed 2 s ago
            choice = sched.host.choice
            choice.read_rate, choice.prompt_rate, choice._probed = *rates, choice.clock() - 2.0
        device = DiskDevice(block_size, disk, delay, set(damaged))
        reqs = [request(p, n) for p, n in jobs]
        drive(sched, reqs, in_flight, one_by_one, lambda plan: device.step(plan, sched.take_moves(plan)),
              lambda plan, out: take(sched, plan, *out), sched.disk_waits)
        assert sched.blocks.used == 0 and (sched.host is None or not sched.host.fetching)
        return [r.output for r in reqs], sched, device
    return asyncio.run(main())


def prompts(n: int, length: int = 40) -> list[list[int]]:
    return [[1 + (i * 7 + j * 3) % (VOCAB - 1) for j in range(length)] for i in range(n)]


def reference(jobs):
    return run(jobs, {}, blocks=4096, host=0, disk_blocks=0)[0]


def test_blocks_evicted_from_both_tiers_come_back_from_disk_and_answer_the_same():
    long, *others = prompts(4)
    jobs = [(long, 4), *[(o, 4) for o in others], (long + [5, 6], 4)]
    disk: dict = {}
    got, sched, device = run(jobs, disk)
    assert got == reference(jobs)
    assert sched.host.disk_hits > 0 and device.reads == sched.host.disk_read > 0 and len(disk) >= 10


def test_a_restarted_scheduler_finds_its_prefixes_on_disk():
    long, other = prompts(2)
    disk: dict = {}
    run([(long, 3), (other, 3)], disk)
    got, sched, device = run([(long + [9], 4)], disk)
    assert got == reference([(long + [9], 4)])
    assert sched.host.disk_hits == 40 and device.reads == 10 and sched.host.hits == 0


def test_a_disk_slower_than_computing_is_not_read_and_a_faster_one_is():
    """The disk read 100 blocks of 4 tokens a second and prompts computed at 10,000 tokens a second
    (its last probe 2 s ago): the restarted scheduler computes the prefix again; at 10,000 blocks a
    second it reads it. Both answer as no cache does."""
    long, other = prompts(2)
    disk: dict = {}
    run([(long, 3), (other, 3)], disk)
    job = [(long + [9], 4)]
    slow = run(job, dict(disk), rates=(100.0, 10_000.0))
    fast = run(job, dict(disk), rates=(10_000.0, 10_000.0))
    assert slow[0] == fast[0] == reference(job)
    assert fast[1].host.disk_hits == 40 and fast[2].reads == 10
    assert slow[1].host.disk_hits == 0 and slow[2].reads == 0 and slow[1].host.choice.skipped >= 1


def test_the_choice_between_reading_and_computing_follows_the_measured_rates():
    from neuron.engine.tier_choice import ReadOrCompute

    now = [0.0]
    choice = ReadOrCompute(16, clock=lambda: now[0])
    assert choice.worth_reading()  # nothing measured yet: read
    choice.computed(100, 0.001)  # too few prompt tokens to tell a rate
    assert choice.prompt_rate is None
    choice.computed(2048, 0.1)  # 20,480 tokens a second
    choice.sent([b"a", b"b"])
    now[0] = 0.5
    choice.landed([b"a", b"b", b"c"])  # 2 blocks in 0.5 s: 64 tokens a second
    assert choice.read_rate == 4.0 and choice.worth_reading()  # the first probe
    now[0] = 1.5
    assert not choice.worth_reading()
    for _ in range(30):  # the disk turns fast: 10,000 blocks a second
        choice.sent([b"x"])
        now[0] += 0.0001
        choice.landed([b"x"])
    assert choice.worth_reading()


def test_a_damaged_file_is_never_served_its_request_starts_again():
    long, other = prompts(2)
    disk: dict = {}
    run([(long, 3), (other, 3)], disk)
    damaged = set(list(disk)[3:6])
    got, sched, device = run([(long + [9], 4)], disk, damaged=damaged, delay=2)
    assert got == reference([(long + [9], 4)])
    assert sched.preemptions >= 1 and sched.host.disk_read < 10


@settings(max_examples=120, deadline=None)
@given(
    which=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(1, VOCAB - 1), max_size=6), st.integers(1, 6)),
                   min_size=1, max_size=8),
    blocks=st.integers(12, 24), host=st.integers(1, 8), disk_blocks=st.integers(1, 40),
    block_size=st.sampled_from([2, 4]), delay=st.integers(0, 3), in_flight=st.integers(1, 3),
    one_by_one=st.booleans(), damage=st.integers(0, 5),
)
def test_small_tiers_with_slow_and_damaged_reads_give_what_no_cache_gives(
        which, blocks, host, disk_blocks, block_size, delay, in_flight, one_by_one, damage):
    base = prompts(4, 24)
    jobs = [(base[i] + suffix, n) for i, suffix, n in which]
    if any(len(p) + n > blocks * block_size - block_size for p, n in jobs):
        return  # a request that can never fit alone is refused at the door
    want = reference(jobs)
    disk: dict = {}
    got, sched, _ = run(jobs, disk, blocks=blocks, block_size=block_size, host=host, disk_blocks=disk_blocks,
                        delay=delay, in_flight=in_flight, one_by_one=one_by_one)
    assert got == want and len(disk) <= disk_blocks
    damaged = set(list(disk)[::damage]) if damage else set()
    again, _, _ = run(jobs, disk, blocks=blocks, block_size=block_size, host=host, disk_blocks=disk_blocks,
                      delay=delay, damaged=damaged, in_flight=in_flight, one_by_one=one_by_one)
    assert again == want
