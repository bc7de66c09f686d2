"""What a step costs on this rank's device, measured once at load: each decode graph's replay,
and each prefill graph's replay over a real prompt of its tokens (attention, the recurrent
layers' chunks and a MoE's routing as a prompt runs them). The leader sizes the prompt chunks it
puts beside running decodes by these (``engine/step_budget.py``)."""

from __future__ import annotations

import torch

import protocol as p

ROUNDS = 5


def measure(runner) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """([(decode graph batch, ms)], [(prefill graph tokens, ms)]), each the median of a few
    replays; both empty without prefill graphs. Every rank of a group runs it (the graphs'
    collectives pair up). Slot 0 is left as after a prompt; the next sequence there starts anew."""
    graphs = runner.step_graphs
    if not graphs.decode or not graphs.prefill:
        return [], []
    decode = [(b, _replay_ms(runner, entry[0])) for b, entry in sorted(graphs.decode.items())]
    prefill = []
    ids = torch.randint(0, runner.vocab, (max(graphs.prefill),), generator=torch.Generator().manual_seed(0))
    for n in sorted(graphs.prefill):
        blocks = -(-(n + 1) // runner.bs)
        if n + 1 > runner.cfg.max_len or blocks > runner.kv_blocks:
            break
        # A prompt of n tokens replays the prefill graph of n with its inputs staged: the
        # replays after it repeat that prompt.
        seq = p.StepSeq(slot=0, tokens=ids[:n].tolist(), start_pos=0, sample=True,
                        sampling=p.Sampling(temperature=0.0), blocks=list(range(blocks)),
                        state=0 if runner.states.slots else -1)
        pending = runner.step(p.Step(id=0, epoch=0, step_id=0, seqs=[seq]))
        if pending is not None:
            pending.wait()
        prefill.append((n, _replay_ms(runner, graphs.prefill[n][0])))
    return decode, prefill


def _replay_ms(runner, graph) -> float:
    graph.replay()
    torch.cuda.synchronize(runner.device)
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[ROUNDS // 2]
