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
    collectives pair up). The slots used are left as after a prompt; the next sequence in each
    starts anew."""
    graphs = runner.step_graphs
    if not graphs.decode or not graphs.prefill:
        return [], []
    decode = [(b, _replay_ms(runner, entry[0])) for b, entry in sorted(graphs.decode.items())]
    prefill = []
    ids = torch.randint(0, runner.vocab, (max(graphs.prefill),), generator=torch.Generator().manual_seed(0))
    for n in sorted(graphs.prefill):
        # A prompt of n tokens replays the prefill graph of n with its inputs staged: the
        # replays after it repeat that prompt. Past max_len, several prompts make the n tokens.
        seqs, start, block = [], 0, 0
        while start < n:
            take = min(n - start, runner.cfg.max_len - 1)
            blocks = -(-(take + 1) // runner.bs)
            seqs.append(p.StepSeq(slot=len(seqs), tokens=ids[start: start + take].tolist(), start_pos=0, sample=True,
                                  sampling=p.Sampling(temperature=0.0), blocks=list(range(block, block + blocks)),
                                  state=len(seqs) if runner.states.slots else -1))
            start, block = start + take, block + blocks
        if block > runner.kv_blocks or len(seqs) > min(runner.cfg.max_seqs, runner.states.slots or runner.cfg.max_seqs):
            break
        pending = runner.step(p.Step(id=0, epoch=0, step_id=0, seqs=seqs))
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
