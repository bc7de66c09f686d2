"""The leader's KV-block allocator and the scheduler that plans steps over it (pure Python)."""

from __future__ import annotations

import asyncio

import pytest

from neuron.engine.blocks import BlockManager, OutOfBlocks
from neuron.engine.request import GenRequest
from neuron.engine.scheduler import DEVICE_TOKEN, Scheduler
from protocol import Sampling


def test_blocks_fill_up_then_refuse_then_come_back_when_freed():
    bm = BlockManager(4, 16)
    a, b = [], []
    assert bm.grow(a, 33) == [0, 1, 2] and bm.free_count == 1
    assert bm.grow(a, 48) == [] and bm.grow(b, 1) == [3]
    with pytest.raises(OutOfBlocks):
        bm.grow(a, 49)
    assert a == [0, 1, 2]  # a failed grow takes nothing
    bm.release(a)
    assert a == [] and bm.free_count == 3 and bm.used == 1
    assert bm.grow(a, 48) == [0, 1, 2] and bm.free_count == 0


def test_a_block_is_released_only_once():
    bm = BlockManager(2, 4)
    table = bm.allocate(1)
    bm.refs[table[0]] += 1  # a second owner (a shared prefix)
    bm.release(list(table))
    assert bm.free_count == 1  # still held by the other owner
    bm.release(table)
    assert bm.free_count == 2
    with pytest.raises(RuntimeError):
        bm.release([0])


def request(prompt_len: int, max_tokens: int = 100) -> GenRequest:
    return GenRequest(prompt=list(range(1, prompt_len + 1)), sampling=Sampling(temperature=0.0), max_tokens=max_tokens,
                      stop_token_ids=frozenset())


def run(coro):
    return asyncio.run(coro)


def test_a_request_waits_until_its_prompt_blocks_fit():
    async def main():
        s = Scheduler(max_slots=4, max_len=64, num_blocks=4, block_size=16, max_batch_tokens=256, prefill_chunk=64)
        big, small = request(40), request(40)
        s.waiting.extend([big, small])
        assert s.admit() == [big]  # 3 blocks; the next would need 3 more (and one kept in hand)
        assert list(s.waiting) == [small]
        s.release(big)
        assert s.admit() == [small] and s.blocks.used == 3
    run(main())


def test_overlapped_plans_feed_decodes_from_the_device_until_a_token_is_known():
    async def main():
        s = Scheduler(max_slots=2, max_len=64, num_blocks=8, block_size=16, max_batch_tokens=256, prefill_chunk=64)
        r = request(5)
        s.waiting.append(r)
        s.admit()
        first = s.schedule()  # the prompt, sampling its last position
        assert [(x.tokens, x.start_pos, x.sample, x.start, x.blocks) for x in first] == [([1, 2, 3, 4, 5], 0, True, True, [0])]
        second = s.schedule()  # planned before the first one's token came back
        assert [(x.tokens, x.start_pos, x.sample, x.blocks) for x in second] == [([DEVICE_TOKEN], 5, True, [])]
        assert r.pending == 2 and r.computed == 6
        r.pending -= 1
        r.output.append(42)  # the first step's token arrives
        third = s.schedule()
        assert [(x.tokens, x.start_pos) for x in third] == [([DEVICE_TOKEN], 6)]
        r.pending -= 2
        r.output += [43, 44]
        assert [(x.tokens, x.start_pos) for x in s.schedule()] == [([44], 7)]
    run(main())


def test_a_decode_short_of_blocks_preempts_the_newest_request_which_is_recomputed_later():
    async def main():
        s = Scheduler(max_slots=3, max_len=64, num_blocks=4, block_size=4, max_batch_tokens=256, prefill_chunk=64)
        old, new = request(4), request(3)
        s.waiting.extend([old, new])
        assert s.admit() == [old, new]  # 1 + 1 blocks, 2 in hand
        s.schedule()
        for r, tok in ((old, 7), (new, 8)):
            r.pending -= 1
            r.output.append(tok)
        # Both decode, one token a step, until a decode finds no free block: old (the older one)
        # keeps running and the newest request goes back to the queue.
        for _ in range(10):
            plan = s.schedule()
            if s.preemptions:
                break
            for x in plan:
                x.req.pending -= 1
                x.req.output.append(9)
        assert s.preemptions == 1 and [x.req for x in plan] == [old]
        assert list(s.waiting) == [new] and new.computed == 0 and new.blocks == [] and new.slot == -1
        assert new.pending == 0 and len(old.blocks) == 3
        old.pending -= 1
        old.output.append(9)
        s.release(old)
        assert s.admit() == [new]
        recompute = s.schedule()  # its prompt and the tokens it had drawn, then a new draw
        assert recompute[0].tokens == new.prompt + new.output and recompute[0].sample and recompute[0].start
    run(main())
