"""Prompt chunks beside running decodes, sized by the step times measured at load (pure Python;
the measuring itself runs in tests/test_gpu.py)."""

from __future__ import annotations

import asyncio

import pytest

from neuron.engine.scheduler import Scheduler
from neuron.engine.step_budget import FLOOR, StepBudget
from test_blocks import request

DECODE = [(1, 10.0), (2, 10.1), (4, 10.2), (8, 10.5), (16, 11.0), (32, 12.0)]
# A dense model: prompt rows cost a little each on top of the weights every step reads.
DENSE = [(32, 10.8), (64, 11.5), (128, 13.0), (192, 14.5), (256, 16.0), (384, 19.0), (512, 22.0)]
# A MoE model: a few prompt tokens already read nearly every expert.
MOE = [(32, 30.0), (64, 31.0), (128, 33.0), (192, 36.0), (256, 40.0), (384, 47.0), (512, 52.0)]


def decoding(budget: StepBudget, streams: int, **kw) -> Scheduler:
    """A scheduler with ``budget`` whose ``streams`` requests have drawn their first token (they
    decode in the next step)."""
    s = Scheduler(max_slots=16, max_len=4096, num_blocks=2048, block_size=16, max_batch_tokens=2048 + 16,
                  prefill_chunk=2048, step_budget=budget, **kw)
    running = [request(4) for _ in range(streams)]
    s.waiting.extend(running)
    s.admit()
    s.schedule()  # their prompts, alone: no decodes yet
    for r in running:
        r.pending -= 1
        r.output.append(7)
    return s


def test_the_largest_bucket_within_the_slowdown_takes_the_prompt_beside_the_decodes():
    b = StepBudget(DECODE, DENSE, slowdown=1.4)
    assert b.chunk(1) == 128 - 1  # 13.0 ms <= 1.4 x 10.0 < 14.5
    assert b.chunk(8) == 192 - 8  # 14.5 ms <= 1.4 x 10.5
    assert b.chunk(32) == 256 - 32  # 16.0 <= 1.4 x 12.0 (the decode graph of 32 is slower)
    assert b.table() == {"1": 127, "2": 126, "4": 124, "8": 184, "16": 176, "32": 224}
    assert StepBudget(DECODE, DENSE, slowdown=2.0).chunk(8) == 384 - 8  # 19.0 <= 21.0
    # Nothing within: the bucket that holds the decodes back least per prompt token (0.3 ms over 24).
    assert StepBudget(DECODE, DENSE, slowdown=1.0).chunk(8) == 32 - 8


def test_where_no_bucket_fits_the_prompt_goes_in_the_fewest_slow_steps():
    b = StepBudget(DECODE, MOE, slowdown=1.4)
    # Per prompt token: 32 -> 19.5/24, 64 -> 20.5/56, ..., 512 -> 41.5/504: the largest wins.
    assert b.chunk(8) == 512 - 8
    assert b.chunk(512 - FLOOR) == FLOOR and b.chunk(500) == 0  # none has FLOOR prompt tokens beside 500 rows


def test_the_scheduler_sizes_a_chunk_beside_decodes_by_the_budget():
    asyncio.run(_sizes_a_chunk())


async def _sizes_a_chunk():
    budget = StepBudget(DECODE, DENSE, slowdown=1.4)
    s = decoding(budget, 4, prefill_chunk_decoding=100)
    long = request(3000)
    s.waiting.append(long)
    s.admit()
    plan = s.schedule()
    chunks = [len(x.tokens) for x in plan if x.req is long]
    assert chunks == [budget.chunk(4)] and budget.chunk(4) == 128 - 4
    assert sum(len(x.tokens) for x in plan) == 128  # the step fills the prefill graph of 128 rows
    alone = Scheduler(max_slots=8, max_len=4096, num_blocks=1024, block_size=16, max_batch_tokens=2048 + 8,
                      prefill_chunk=2048, prefill_chunk_decoding=100, step_budget=budget)
    other = request(3000)
    alone.waiting.append(other)
    alone.admit()
    assert [len(x.tokens) for x in alone.schedule()] == [2048]  # no decodes: a whole chunk
    without = Scheduler(max_slots=8, max_len=4096, num_blocks=1024, block_size=16, max_batch_tokens=2048 + 8,
                        prefill_chunk=2048, prefill_chunk_decoding=100)
    assert without._chunk_beside(4) == 100  # no measurements (the CPU): the configured chunk


def test_a_short_prompt_goes_in_whole_beside_decodes_and_a_long_one_by_the_budget():
    asyncio.run(_short_and_long())


async def _short_and_long():
    budget = StepBudget(DECODE, DENSE, slowdown=1.0)  # nothing within: 28 tokens beside 4 rows
    s = decoding(budget, 4)
    long, short = request(3000), request(150)
    s.waiting.extend([long, short])
    s.admit()
    plan = s.schedule()
    assert budget.chunk(4) == 28
    # The short one (it fits WHOLE) at once, and draws; then the long prompt by the budget.
    assert [(x.req, len(x.tokens), x.sample) for x in plan if x.req in (long, short)] == \
        [(short, 150, True), (long, 28, False)]
    plan = s.schedule()
    assert [len(x.tokens) for x in plan if x.req is long] == [budget.chunk(5)] == [27]  # beside 5 decodes now


def test_short_prompts_go_before_a_long_one_which_keeps_a_floor_of_the_budget():
    asyncio.run(_short_first())


async def _short_first():
    budget = StepBudget(DECODE, DENSE, slowdown=2.0)  # 376 tokens beside 8 rows
    s = decoding(budget, 8)
    long = request(3000)
    shorts = [request(100) for _ in range(4)]
    s.waiting.extend([long, *shorts])  # the long one came first
    s.admit()
    plan = s.schedule()
    assert budget.chunk(8) == 376
    # Three short prompts whole (300 tokens), then the long one's chunk; the fourth would leave it
    # fewer than FLOOR tokens of the budget.
    assert [(x.req, len(x.tokens)) for x in plan if x.req in (long, *shorts)] == \
        [(shorts[0], 100), (shorts[1], 100), (shorts[2], 100), (long, 76)]
    assert 376 - 300 >= FLOOR


def test_a_slowdown_below_one_or_not_a_number_is_refused_by_name(tmp_path):
    from neuron.config import ConfigError, load_config

    for value, words in (("0.5", "decode_slowdown at least 1"), ("nan", "decode_slowdown at least 1"),
                         ('"fast"', "decode_slowdown")):
        path = tmp_path / "neuron.toml"
        path.write_text(f"[engine]\ndecode_slowdown = {value}\n")
        with pytest.raises(ConfigError, match=words):
            load_config(path)
    path.write_text("[engine]\ndecode_slowdown = 2\n")
    assert load_config(path).engine.decode_slowdown == 2.0


def test_a_model_with_experts_takes_a_prompt_alone_in_longer_chunks_on_a_gpu_only():
    """A chunk of a MoE prompt reads nearly every expert, so on a GPU it goes in chunks of
    ``MOE_CHUNK``; dense models keep 2048, the CPU 256, and a configured chunk wins."""
    from neuron.config import EngineConfig, ModelEntry
    from neuron.engine.shape import MOE_CHUNK, engine_sizes

    entry = ModelEntry(max_slots=16)
    assert MOE_CHUNK > 2048
    assert engine_sizes(EngineConfig(), entry, True, experts=True) == (MOE_CHUNK + 16, MOE_CHUNK, 192)
    assert engine_sizes(EngineConfig(), entry, True, experts=False) == (2048 + 16, 2048, 192)
    assert engine_sizes(EngineConfig(), entry, False, experts=True) == (1024, 256, 256)
    assert engine_sizes(EngineConfig(prefill_chunk=1024), entry, True, experts=True) == (1040, 1024, 192)
