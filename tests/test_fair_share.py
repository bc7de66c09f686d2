"""Fair share between principals in the scheduler (pure Python, the real Scheduler): under random
arrivals from several weighted principals, each one's share of the admitted work converges to its
weight, nobody waits forever, a principal's cap of running requests holds without blocking the
others, priority orders a principal's own requests, and preemption takes from the principal
holding the most blocks."""

from __future__ import annotations

import asyncio
import random

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from neuron.engine.scheduler import Scheduler
from test_blocks import request


def asking(principal: str, weight: float = 1.0, prompt: int = 8, max_tokens: int = 24, **kw):
    req = request(prompt, max_tokens)
    req.principal, req.weight = principal, weight
    for key, value in kw.items():
        setattr(req, key, value)
    return req


def scheduler(slots: int) -> Scheduler:
    return Scheduler(max_slots=slots, max_len=4096, num_blocks=4096, block_size=16, max_batch_tokens=4096,
                     prefill_chunk=4096)


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.integers(1, 4), min_size=2, max_size=4), seed=st.integers(0, 2**31),
       slots=st.integers(1, 6))
def test_every_principals_share_of_admitted_work_converges_to_its_weight(weights, seed, slots):
    # A principal with nothing running takes a slot from one running two or more: weights decide
    # where every principal's share is more than a slot, or where there is only one slot to share.
    assume(slots == 1 or slots * min(weights) > sum(weights))

    async def main():
        rnd = random.Random(seed)
        s = scheduler(slots)
        names = [f"p{i}" for i in range(len(weights))]
        work = dict.fromkeys(names, 0)
        waited: dict[int, int] = {}
        for step in range(3000):
            for name, w in zip(names, weights):  # every principal keeps a backlog, of random sizes
                while s.waiting.waiting_of(name) < 3:
                    req = asking(name, w, prompt=rnd.randint(1, 64), max_tokens=rnd.randint(1, 64))
                    waited[id(req)] = step
                    s.waiting.append(req)
            for req in s.admit():
                if waited.pop(id(req), None) is not None:  # not a request that gave its slot up and came back
                    work[req.principal] += len(req.prompt) + req.max_tokens
            for req in list(s.running):
                if rnd.random() < 0.3:
                    s.release(req)
        # Nobody waits forever: whoever came in the first two thirds of the run got in.
        assert not [since for since in waited.values() if since < 2000]
        total = sum(work.values())
        for name, w in zip(names, weights):
            assert abs(work[name] / total - w / sum(weights)) < 0.03, (work, weights)
    asyncio.run(main())


def test_a_newcomer_is_admitted_ahead_of_a_backlogged_principals_waiting_requests():
    async def main():
        s = scheduler(4)
        s.waiting.extend([asking("agent") for _ in range(10)])
        assert len(s.admit()) == 4
        bob = asking("bob")
        s.waiting.append(bob)
        s.release(s.running[0])
        assert s.admit() == [bob]
    asyncio.run(main())


def test_a_cap_on_running_holds_one_principal_and_not_the_others():
    async def main():
        s = scheduler(8)
        s.waiting.extend([asking("agent", max_running=3) for _ in range(6)] + [asking("bob") for _ in range(2)])
        admitted = s.admit()
        assert [r.principal for r in admitted].count("agent") == 3 and len(admitted) == 5
        assert s.waiting.waiting_of("agent") == 3 and s.admit() == []
        s.release(next(r for r in s.running if r.principal == "agent"))
        assert [r.principal for r in s.admit()] == ["agent"]
    asyncio.run(main())


def test_priority_orders_a_principals_own_requests_only():
    async def main():
        s = scheduler(1)
        late_urgent = asking("agent", priority=-5)
        first, bob = asking("agent"), asking("bob", priority=10)
        s.waiting.extend([first, bob, late_urgent])
        order = []
        for _ in range(3):
            order += s.admit()
            s.release(order[-1])
        assert order == [bob, late_urgent, first]  # bob came first; agent's urgent one before its first
    asyncio.run(main())


def test_preemption_takes_from_the_principal_holding_the_most_blocks():
    async def main():
        s = Scheduler(max_slots=4, max_len=64, num_blocks=8, block_size=4, max_batch_tokens=256, prefill_chunk=64)
        big = [asking("agent", prompt=8), asking("agent", prompt=8)]
        small = asking("bob", prompt=4)
        s.waiting.extend([small, *big])
        assert len(s.admit()) == 3  # 1 + 2 + 2 blocks, 3 in hand
        s.schedule()
        for r in s.running:
            r.pending -= 1
            r.output.append(7)
        while not s.preemptions:
            for x in s.schedule():
                x.req.pending -= 1
                x.req.output.append(9)
        assert [r.principal for r in s.waiting] == ["agent"] and small in s.running
    asyncio.run(main())


def test_idle_principals_are_forgotten_and_start_again_at_the_clock():
    from neuron.engine.fair import PASSES_KEPT

    async def main():
        s = scheduler(1)
        for i in range(PASSES_KEPT + 10):  # a gateway naming a new account each time
            s.waiting.append(asking(f"acct-{i}"))
            s.release(s.admit()[0])
        assert len(s.waiting.passes) <= PASSES_KEPT + 1
        late, agent = asking("acct-0"), [asking("agent") for _ in range(3)]
        s.waiting.extend(agent + [late])
        order = []
        for _ in range(4):
            order += s.admit()
            s.release(order[-1])
        assert order.index(late) <= 1  # back at the clock: not behind the agent's backlog
    asyncio.run(main())


def test_a_principal_with_nothing_running_takes_a_slot_from_the_one_running_the_most():
    async def main():
        s = scheduler(4)
        heavy = [asking("agent", max_tokens=2000) for _ in range(6)]
        s.waiting.extend(heavy)
        assert s.admit() == heavy[:4]
        s.schedule()
        light = asking("bob", max_tokens=4)
        s.waiting.append(light)
        assert s.admit() == [light]  # at the next step, not when a stream ends
        assert heavy[3] not in s.running and s.preemptions == 1  # the newest of the agent's four
        assert [r for r in s.waiting][:1] == [heavy[3]]  # the agent's next, before its two never started
        carol = asking("carol", max_tokens=4)
        s.waiting.append(carol)
        assert s.admit() == [carol] and heavy[2] not in s.running
        dave = asking("dave", max_tokens=4)
        s.waiting.append(dave)
        assert s.admit() == [dave] and heavy[1] not in s.running  # four principals, a slot each
        eve = asking("eve", max_tokens=4)
        s.waiting.append(eve)
        assert s.admit() == [] and s.preemptions == 3  # nobody runs two: she waits for a slot
        s.release(light)
        assert len(s.admit()) == 1 and len(s.running) == 4
        assert sorted(r.principal for r in s.running) == sorted({r.principal for r in s.running})
    asyncio.run(main())
