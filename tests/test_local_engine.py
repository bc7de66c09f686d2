"""The in-process engine client (``neuron/engine/client.py``) on a real model and its rank: the
API side's output state goes in, the engine's own sequence is made from its ``EngineRequest``
alone, and what it draws comes back as the state's events. Every way a sequence ends (its
length, a stop string found on the API side, a stop id, an abort before or after it ran, a
refusal) lets go of it."""

from __future__ import annotations

import asyncio

from neuron.config import Config, ModelEntry
from neuron.local_client import LocalClient
from neuron.server.output.detokenizer import Detokenizer
from neuron.server.output.state import OutputState, TokenEvent
from neuron.server.output.stops import StopMatcher
from protocol import Sampling
from protocol.api_core import EngineRequest
from protocol.engine_client import FinishEvent

PROMPT = [5, 17, 42, 99, 7, 3]


def sequence(handle, max_tokens: int, stops: list[str] = (), stop_ids: list[int] = (),
             request_id: str = "req-t") -> OutputState:
    wire = EngineRequest(request_id, PROMPT, Sampling(temperature=0.0, prompt_len=len(PROMPT),
                                                      stop_token_ids=sorted(stop_ids)),
                         max_tokens, sorted(stop_ids), principal="tester")
    return OutputState(wire, Detokenizer(handle.spec.tokenizer.tokenizer), StopMatcher(list(stops)))


async def drain(out: OutputState) -> tuple[str, list[int], FinishEvent]:
    text, ids = "", []
    while True:
        ev = await asyncio.wait_for(out.events.get(), 60)
        if isinstance(ev, FinishEvent):
            return text, ids, ev
        assert isinstance(ev, TokenEvent)
        text, ids = text + ev.text, ids + ev.token_ids


def test_every_way_a_sequence_ends_comes_back_and_lets_go_of_it(tiny_checkpoint, tmp_path):
    finished: list[tuple[str, str, str]] = []

    async def main():
        cfg = Config(models=[])
        cfg.runtime.dir = str(tmp_path)
        client = LocalClient(cfg, on_finish=lambda model, out, ev: finished.append((model, out.request_id, ev.reason)))
        try:
            handle = await client.load(ModelEntry(model=str(tiny_checkpoint), id="tiny", max_model_len=256,
                                                  max_slots=1))
            engine = handle.client

            whole = sequence(handle, 12, request_id="whole")
            engine.submit(whole)
            await whole.admitted
            text, ids, fin = await drain(whole)
            assert (fin.reason, fin.completion_tokens, fin.prompt_tokens) == ("length", 12, len(PROMPT))
            assert ids == whole.output and len(ids) == 12 and whole.finished

            # A stop string the API side finds ends the sequence there, with the text before it.
            cut = next(i for i in range(1, len(text)) if text[i:].strip() and text[:i].strip())
            stop = text[cut:cut + 3]
            stopped = sequence(handle, 12, stops=[stop], request_id="stopped")
            engine.submit(stopped)
            stext, sids, sfin = await drain(stopped)
            assert sfin.reason == "stop" and stext == text[:text.index(stop)] and len(sids) < 12

            # A stop id: the sequence ends with it, its text not shown.
            by_id = sequence(handle, 12, stop_ids=[ids[3]], request_id="by-id")
            engine.submit(by_id)
            _, bids, bfin = await drain(by_id)
            assert bfin.reason == "stop" and bids == ids[:ids.index(ids[3]) + 1]

            # One slot: the second waits; aborted before it runs it is dropped without a word,
            # the first, aborted while it runs, ends as an abort.
            running, waiting = sequence(handle, 200, request_id="running"), sequence(handle, 4, request_id="waiting")
            engine.submit(running)
            engine.submit(waiting)
            await running.admitted
            assert not waiting.admitted.done()
            engine.abort(waiting)
            engine.abort(running)
            _, _, afin = await drain(running)
            assert afin.reason == "abort"
            await asyncio.sleep(0.2)
            assert waiting.events.empty() and not engine.running
            assert [f for f in finished if f[1] in ("whole", "stopped", "by-id", "running")] == \
                [("tiny", "whole", "length"), ("tiny", "stopped", "stop"), ("tiny", "by-id", "stop"),
                 ("tiny", "running", "abort")]
        finally:
            await client.shutdown()

    asyncio.run(main())
