"""Running our model code the way a rank does, outside the server, for parity checks against HF
transformers: last-position logits and greedy tokens of a few prompts, at TP=1 in this process or
at TP>1 in real processes joined by gloo, or NCCL on GPUs (one process per rank, as the server
runs them).

    jobs = [ParityJob("qwen3", fmt="safetensors", paths=[...], config=cfg, prompts=[[1, 2, 3]], new_tokens=8)]
    results = run_parity(jobs, world=2)   # one ParityResult per job, from rank 0 (+ every rank's bytes)
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol import ModelConfig

DTYPES = ("float32", "bfloat16", "float16")
TEARDOWN_S = 30.0  # from the last rank's results to every rank's exit


@dataclass
class ParityJob:
    name: str
    fmt: str  # safetensors | gguf
    paths: list[str]
    config: ModelConfig
    prompts: list[list[int]]
    new_tokens: int = 0
    dtype: str = "float32"
    max_len: int = 128
    quant: str | None = None  # in-situ quantization: q8_0 | q4
    score: list[list[int]] = field(default_factory=list)  # sequences to run teacher-forced
    dense: bool = False  # every weight dequantized to ``dtype``: the reference of a packed model
    score_greedy: bool = False  # also score each prompt followed by its own greedy continuation
    device: str = "cpu"  # cuda: one GPU per rank (rank r on cuda:r)
    forced: list[list[int]] = field(default_factory=list)  # per prompt: tokens fed one decode step each
    checkpoint_quant: Any = None  # protocol.CheckpointQuant: the publisher quantized the checkpoint
    keep_scored: bool = False  # also return the logits at every position of the ``score`` sequences
    draft_rows: int = 0  # RunnerConfig.draft_rows: the CUDA graphs of steps with drafts
    mtp: bool = False  # load the checkpoint's MTP layer (StepSeq.propose)


@dataclass
class ParityResult:
    name: str
    logits: list[Any]  # per prompt: float32 tensor [vocab], the last prompt position's logits
    greedy: list[list[int]]  # per prompt: ``new_tokens`` argmax tokens, decoded through the KV cache
    load_seconds: float
    weight_bytes: list[int] = field(default_factory=list)  # one per rank
    argmax: list[list[int]] = field(default_factory=list)  # per ``score`` sequence: the argmax at every position
    forced_argmax: list[list[int]] = field(default_factory=list)  # per prompt: the argmax before each forced token
    scored: list[Any] = field(default_factory=list)  # with ``keep_scored``: per sequence, float32 [positions, vocab]


def top1(a: ParityResult, b: ParityResult) -> float:
    """The share of teacher-forced positions where ``a`` and ``b`` (the same ``score`` sequences)
    pick the same argmax."""
    pairs = [(p, q) for x, y in zip(a.argmax, b.argmax) for p, q in zip(x, y)]
    return sum(p == q for p, q in pairs) / len(pairs)


def scored_rms(a: ParityResult, b: ParityResult) -> float:
    """The RMS difference of ``a``'s and ``b``'s teacher-forced logits (``keep_scored``) over every
    position and token, against the spread of ``b``'s logits about each position's mean."""
    import torch

    x, y = torch.cat(a.scored), torch.cat(b.scored)
    return ((x - y).pow(2).mean() / (y - y.mean(-1, keepdim=True)).pow(2).mean()).sqrt().item()


class DenseView:
    """A weight source that offers only floats: the model it builds holds every weight dense."""

    def __init__(self, src: Any) -> None:
        self.get, self.has = src.get, src.has


def open_source(fmt: str, paths: list[str], config: ModelConfig, quant: str | None = None,
                dense: bool = False, checkpoint_quant: Any = None, device: Any = None) -> Any:
    """``device``: where in-situ quantization and the unpacking of published integers run, as a
    rank does (its GPU; None: the CPU)."""
    if fmt == "gguf":
        from neuron.loader.gguf_open import open_gguf

        src: Any = open_gguf(paths[0], config)
    else:
        from neuron.loader.safetensors_source import SafetensorsSource

        src = SafetensorsSource(list(paths))
        if checkpoint_quant is not None:
            from neuron.loader.published import PublishedSource

            src = PublishedSource(src, checkpoint_quant, device)
    if quant:
        from neuron.loader.insitu import QuantizingSource

        src = QuantizingSource(src, quant, device)
    return DenseView(src) if dense else src


def build(job: ParityJob, world: int = 1, rank: int = 0) -> tuple[Any, float]:
    """This rank's model runner for ``job`` (the family's model behind the rank's ModelRunner, one
    slot per prompt) and the seconds it took to build."""
    import torch

    from neuron.models import families
    from neuron.models.tp_linear import packed_kernel_for
    from neuron.models.quant import GROUP
    from neuron.runner.runner import ModelRunner, RunnerConfig

    t0 = time.perf_counter()
    dtype = getattr(torch, job.dtype)
    device = torch.device(f"cuda:{rank}") if job.device == "cuda" else torch.device("cpu")
    src = open_source(job.fmt, job.paths, job.config, job.quant, job.dense, job.checkpoint_quant,
                      device if device.type == "cuda" else None)
    # A dense reference of packed weights splits where the packed model does (on whole quant
    # groups): split elsewhere, in-situ quantization would group its columns differently.
    quantized = getattr(src, "quantized", False) or (job.dense and bool(job.quant))
    block = GROUP if packed_kernel_for(device, dtype) and quantized else 1
    model = families.family(job.config.family).build(job.config, world, rank, src, dtype=dtype, device=device,
                                                     max_len=job.max_len, block=block,
                                                     **({"mtp": True} if job.mtp else {}))
    # A cache of whole blocks for these sequences only (run_model gives each its own), not the
    # device's free memory.
    seqs, bs = max(1, len(job.prompts)), RunnerConfig.block_size
    runner = ModelRunner(model, RunnerConfig(max_seqs=seqs, max_len=job.max_len,
                                             kv_tokens=seqs * -(-job.max_len // bs) * bs,
                                             draft_rows=job.draft_rows), rank)
    return runner, time.perf_counter() - t0


def run_model(runner: Any, job: ParityJob) -> tuple[list[Any], list[list[int]]]:
    """Prefill every prompt in one batched step (one slot and its own KV blocks each), then decode
    greedily one token per sequence per step, all sequences batched together, each step's input
    taken from the rank's last draw (as overlapped steps do)."""
    prefill = _prefill(runner, job)
    first = [row.clone() for row in runner.forward_logits(prefill)]
    return first, _decode(runner, prefill, job.new_tokens)


def run_forced_decode(runner: Any, job: ParityJob) -> list[list[int]]:
    """Teacher forcing through the decode path: as ``run_model``, but each step's input is the
    sequence's next ``job.forced`` token (so a few prompts decode as a server's few streams do);
    per prompt, the argmax before each forced token."""
    return _decode(runner, _prefill(runner, job), len(job.forced[0]), job.forced) if job.forced else []


def _prefill(runner: Any, job: ParityJob) -> list[Any]:
    from protocol import Sampling, StepSeq

    per_seq = -(-job.max_len // runner.bs)
    greedy = Sampling(temperature=0.0)
    return [StepSeq(slot=i, tokens=list(p), start_pos=0, sample=True, sampling=greedy,
                    blocks=list(range(i * per_seq, (i + 1) * per_seq)), state=_state(runner, i))
            for i, p in enumerate(job.prompts)]


def _state(runner: Any, slot: int) -> int:
    """The state slot of the sequence in ``slot``: its own, where the model keeps state."""
    return slot if runner.states.slots else -1


def _decode(runner: Any, seqs: list[Any], steps: int, forced: list[list[int]] | None = None) -> list[list[int]]:
    """``steps`` batched steps from the prefill ``seqs``: each sequence's draws. A step's input is
    the rank's last draw, or with ``forced`` the sequence's token of that step."""
    from protocol import Step, StepSeq

    tokens: list[list[int]] = [[] for _ in seqs]
    for i in range(steps):
        pending = runner.step(Step(id=0, epoch=0, step_id=0, seqs=seqs))  # None on ranks but 0
        drawn = pending.wait()[0] if pending is not None else [-1] * len(seqs)
        for out, tok in zip(tokens, drawn):
            out.append(tok)
        seqs = [StepSeq(slot=s.slot, tokens=[forced[j][i] if forced else -1], start_pos=s.start_pos + len(s.tokens),
                        sample=True, state=s.state) for j, s in enumerate(seqs)]
    return tokens


def run_teacher_forced(runner: Any, job: ParityJob, greedy: list[list[int]]) -> tuple[list[list[int]], list[Any]]:
    """The argmax after every position of each ``job.score`` sequence (or prompt + ``greedy``),
    one prefill each, and with ``job.keep_scored`` the logits themselves (on the CPU)."""
    from protocol import Sampling, StepSeq

    out, kept = [], []
    seqs = job.score or ([p + g for p, g in zip(job.prompts, greedy)] if job.score_greedy else [])
    for seq in seqs:
        step = StepSeq(slot=0, tokens=list(seq), start_pos=0, sample=True, sampling=Sampling(temperature=0.0),
                       blocks=list(range(-(-len(seq) // runner.bs))), state=_state(runner, 0))
        logits = runner.forward_logits([step], every_position=True)
        out.append(logits.argmax(dim=-1).tolist())
        if job.keep_scored:
            kept.append(logits.float().cpu())
    return out, kept


def run_job(job: ParityJob, runner: Any, seconds: float) -> ParityResult:
    """``job`` on a built model: every part of its result."""
    logits, greedy = run_model(runner, job)
    argmax, scored = run_teacher_forced(runner, job, greedy)
    return ParityResult(job.name, logits, greedy, seconds, [runner.model.weight_bytes()], argmax,
                        run_forced_decode(runner, job), scored)


def run_parity(jobs: list[ParityJob], world: int = 1, timeout: float = 300.0) -> list[ParityResult]:
    """Every job at tensor-parallel ``world``: in this process at 1, else in ``world`` spawned
    processes joined by a gloo group (NCCL where every job is on the GPU); the results are rank
    0's, with every rank's weight bytes."""
    if world == 1:
        results = []
        for job in jobs:
            results.append(run_job(job, *build(job)))
        return results
    import torch.multiprocessing as mp

    for attempt in range(3):  # the free port taken by another process before rank 0 listened on it
        try:
            return _spawned(jobs, world, timeout)
        except mp.ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _spawned(jobs: list[ParityJob], world: int, timeout: float) -> list[ParityResult]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="neuron-parity-") as tmp:
        port = _free_port()
        ctx = mp.start_processes(_rank_main, args=(world, port, jobs, tmp), nprocs=world, join=False,
                                 start_method="spawn")
        deadline, why, written = time.monotonic() + timeout, f"did not finish in {timeout}s", False
        while not ctx.join(timeout=1.0):
            if not written and all((Path(tmp) / f"rank{r}.pkl").exists() for r in range(world)):
                written, deadline = True, min(deadline, time.monotonic() + TEARDOWN_S)
                why = f"wrote their results but did not exit within {TEARDOWN_S}s"
            if time.monotonic() > deadline:
                _stop(ctx.processes)
                raise TimeoutError(f"TP={world} parity ranks {why} (their stacks are on stderr)")
        per_rank = [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    results = per_rank[0]
    for i, res in enumerate(results):
        res.weight_bytes = [per_rank[r][i].weight_bytes[0] for r in range(world)]
    return results


def _stop(procs: list[Any]) -> None:
    """Kill the ranks still alive, each first made to print its threads' stacks."""
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:  # one at a time: their stacks would interleave
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.5)
    for proc in alive:
        proc.kill()


def _rank_main(rank: int, world: int, port: int, jobs: list[ParityJob], out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it waits, when run_parity stops it

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cuda = all(job.device == "cuda" for job in jobs)  # NCCL between GPUs, as the daemon's ranks
    kwargs = {}
    if cuda:  # the communicator bound to its GPU at once, as the daemon's ranks bind theirs
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world,
                            rank=rank, **kwargs)
    try:
        results = []
        for job in jobs:
            runner, seconds = build(job, world, rank)
            results.append(run_job(job, runner, seconds))
            del runner
        (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
