"""Constrained sequences overlap their steps: a step goes out with a row's mask to come
(``StepSeq.mask_later``) and the mask follows it (``StepMasks``) once the token before is known.
The answers are those of steps that never overlap; a stream that ends meanwhile leaves no rank
waiting; a mask that never comes fails the step instead of hanging it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import pytest
import torch

import protocol as p
from conftest import ROOT, TINY, start_server
from neuron.runner.late_masks import LateMasks
from neuron.runner.sampler import DeviceSampler
from test_sampler_constraints import V, draw, mask_of
from test_structured_output import MESSAGES, PERSON, SCHEMA_FORMAT, aclient


def test_a_step_takes_its_masks_when_they_come_and_older_leftovers_go():
    box = LateMasks()
    box.put(p.StepMasks(id=0, epoch=1, step_id=3, slots=[9], masks=[b"old"], which=[0]))  # a step that never sampled
    got: list = []
    taker = threading.Thread(target=lambda: got.append(box.take(5, [1, 2, 7], timeout=10)))
    taker.start()
    time.sleep(0.2)
    assert taker.is_alive()  # waits: nothing for step 5 yet
    box.put(p.StepMasks(id=0, epoch=1, step_id=5, slots=[2, 7], masks=[b"two"], which=[0, 0]))
    time.sleep(0.1)
    assert taker.is_alive()  # slot 1's mask is still out
    box.put(p.StepMasks(id=0, epoch=1, step_id=5, slots=[1], masks=[b""], which=[0]))
    taker.join(5)
    assert got == [[None, b"two", b"two"]]  # b"": that row samples unconstrained; one mask, two rows
    assert not box._frames  # step 3's leftover went with step 5
    with pytest.raises(TimeoutError, match="slots \\[4\\]"):
        box.take(6, [4], timeout=0.2)
    with pytest.raises(ValueError, match="name no mask"):
        box.put(p.StepMasks(id=0, epoch=1, step_id=6, slots=[4], masks=[b"x"], which=[1]))


def test_masks_on_some_rows_leave_the_others_alone():
    logits = torch.randn(3, V)
    logits[:, 3] = 50.0
    sampler = DeviceSampler(4, V, torch.device("cpu"))
    for slot in range(3):
        sampler.start(slot, p.Sampling(temperature=0.0, prompt_len=2))
    tokens = draw(sampler, logits, [0, 1, 2], [2, 2, 2], [None, mask_of({7, 40}), None])
    assert tokens[0] == tokens[2] == 3 and tokens[1] == max((7, 40), key=lambda t: float(logits[1, t]))
    shared, other = mask_of({7, 40}), mask_of({11})  # rows in one grammar state share a mask
    tokens = draw(sampler, logits, [0, 1, 2], [3, 3, 3], [shared, other, shared])
    assert tokens == [max((7, 40), key=lambda t: float(logits[r, t])) if r != 1 else 11 for r in range(3)]


@pytest.fixture(scope="module")
def overlapped(server_tmp, tiny):
    """The tiny model again, with the tap on; beside it (``tiny``) the same model, served with
    steps that never overlap."""
    tap = f"ipc://{server_tmp}/late-tap.sock"
    server = start_server(server_tmp, config=f'[[models]]\nmodel = "{server_tmp / "tiny-tools"}"\nid = "{TINY}"\n'
                                             'max_model_len = 1024\nmax_slots = 8\n'
                                             f'[engine]\nsteps_in_flight = 2\n[debug]\ntap = "{tap}"\n')
    yield server, tap
    server.stop()


@pytest.fixture(scope="module")
def one_step_at_a_time(server_tmp, tiny):
    server = start_server(server_tmp, config=f'[[models]]\nmodel = "{server_tmp / "tiny-tools"}"\nid = "{TINY}"\n'
                                             'max_model_len = 1024\nmax_slots = 8\n[engine]\nsteps_in_flight = 1\n')
    yield server
    server.stop()


def answer(server, seed: int) -> str:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": TINY, "messages": MESSAGES, "response_format": SCHEMA_FORMAT, "max_tokens": 150,
        "temperature": 1.0, "seed": seed})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_overlapped_constrained_steps_give_the_answers_of_steps_one_at_a_time(overlapped, one_step_at_a_time):
    server, tap_endpoint = overlapped
    tap = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "neuron-tap"), "--endpoint", tap_endpoint,
                            "--json", "--no-heartbeats", "--timeout", "60", "--op", "step_masks", "--count", "10"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # let the subscription settle
    for seed in (1, 2, 3):
        text = answer(server, seed)
        jsonschema.validate(json.loads(text), PERSON)
        assert text == answer(one_step_at_a_time, seed)
    out, _ = tap.communicate(timeout=90)
    frames = [json.loads(line)["frame"] for line in out.splitlines()]
    assert len(frames) == 10 and all(len(f["slots"]) == len(f["masks"]) == 1 for f in frames)


async def some_streams_leave(server, leave: int, stop: int, stay: int, max_tokens: int = 150
                             ) -> tuple[list[str], list[str]]:
    """``leave`` clients go away mid-answer, ``stop`` answers end at a stop string (':', after the
    first key: with API processes the core learns of it instead of the next mask), ``stay`` run
    to the end. The stopped answers and the whole ones."""
    async def stream(i: int) -> tuple[str, str | None] | None:
        async with aclient(server) as c:
            text, chunks, finish = "", 0, None
            async for chunk in await c.chat.completions.create(
                    model=TINY, messages=MESSAGES, response_format=SCHEMA_FORMAT, max_tokens=max_tokens,
                    temperature=1.0, seed=50 + i, stream=True, stop=[":"] if leave <= i < leave + stop else None):
                chunks += 1
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if i < leave and chunks == 3 + i:
                    return None  # the client goes away mid-answer
            return text, finish

    done = [x for x in await asyncio.gather(*(stream(i) for i in range(leave + stop + stay))) if x is not None]
    assert all(finish == "stop" for _, finish in done[:stop])
    return [text for text, _ in done[:stop]], [text for text, _ in done[stop:]]


@pytest.mark.parametrize("api_processes,tp", [(0, 1), (2, 1), (0, 2)])
def test_constrained_streams_that_leave_mid_answer_hold_up_no_step(server_tmp, tiny, api_processes, tp):
    """With TP the masks go to the sampling rank only; the other ranks wait in its broadcast."""
    server = start_server(server_tmp, config=f'[server]\napi_processes = {api_processes}\n'
                                             f'[[models]]\nmodel = "{server_tmp / "tiny-tools"}"\nid = "{TINY}"\n'
                                             f'max_model_len = 1024\nmax_slots = 8\ntensor_parallel = {tp}\n')
    try:
        t0 = time.monotonic()
        stopped, texts = asyncio.run(some_streams_leave(server, leave=3, stop=2, stay=3))
        assert len(texts) == 3 and time.monotonic() - t0 < 60
        assert len(stopped) == 2 and all(":" not in text and '"name"' in text for text in stopped)
        for text in texts:
            jsonschema.validate(json.loads(text), PERSON)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            model = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
            if (model["running"], model["slots_used"]) == (0, 0):
                break
            time.sleep(0.2)
        assert (model["running"], model["slots_used"]) == (0, 0)
        assert "no mask for slots" not in server.log() and "step failed" not in server.log()
    finally:
        server.stop()
