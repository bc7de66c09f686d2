"""The CPU ranks' collectives through shared memory (``neuron/models/host_collectives.py``):
real processes in a gloo group, each result compared with gloo's own on the same tensors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from devtools import netns
from neuron.kernels import isa
from neuron.kernels.cpu import KernelUnavailable, cpu_kernels, load_level
from neuron.models import host_collectives
from neuron.models.host_collectives import SLOT_BYTES
from neuron.models.layers import Collectives

try:
    MOD = cpu_kernels().mod
except KernelUnavailable:
    MOD = None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(MOD is None, reason="the CPU kernels are not built")


def _group(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _leave() -> None:
    """Every rank done, then the group torn down, as a rank does (``rank/worker.py``): a process
    that exits with gloo's threads still up can die in their destructors (``terminate called
    without an active exception``, seen once with two test workers side by side)."""
    dist.barrier()
    dist.destroy_process_group()


def _collectives(rank: int, world: int, port: int, out) -> None:
    _group(rank, world, port)
    comm = Collectives(world)
    how = comm.use_host_memory(cpu_kernels().mod, 30.0)
    gen = torch.Generator().manual_seed(100 + rank)
    results = {"how": how, "segments": sorted(f for f in os.listdir("/dev/shm") if f.startswith("neuron-tp-"))}
    # every shape a step makes: a decode row, rows, more than a slot holds, bf16, a strided view
    for name, x in (("row", torch.randn(1, 576, generator=gen)), ("rows", torch.randn(7, 96, generator=gen)),
                    ("big", torch.randn(SLOT_BYTES // 4 * 2 + 33, generator=gen)),
                    ("bf16", torch.randn(4, 64, generator=gen).bfloat16()),
                    ("strided", torch.randn(16, 10, generator=gen)[:, ::2])):
        want = x.clone().float()
        dist.all_reduce(want)
        got = comm.all_reduce(x.clone())
        results[name] = (got.float() - want).abs().max().item()
        results[name + "-all"] = got.float().tolist()
    part = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
    results["gather"] = comm.all_gather_last(part).tolist()
    tokens = torch.tensor([7, 8, 9]) if rank == 0 else torch.zeros(3, dtype=torch.int64)
    results["broadcast"] = comm.broadcast(tokens).tolist()
    out.put((rank, results))
    _leave()


def _spawn(target, world: int, *args) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29000 + os.getpid() % 2000
    procs = [ctx.Process(target=target, args=(r, world, port, out, *args)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    return got


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_give_what_gloo_gives_and_leave_no_segment(world):
    got = _spawn(_collectives, world)
    for rank in range(world):
        r = got[rank]
        assert r["how"] == "shared memory"
        for name in ("row", "rows", "big", "strided"):  # float32: the same sums to rounding
            assert r[name] < 1e-5, (name, r[name])
        assert r["bf16"] < 0.05  # gloo rounds to bf16 after each add; the segment sums in float32
        for name in ("row", "rows", "big", "bf16", "strided"):  # every rank holds the same bits
            assert r[name + "-all"] == got[0][name + "-all"]
        want = torch.cat([torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * k for k in range(world)], dim=-1)
        assert r["gather"] == want.tolist()
        assert r["broadcast"] == [7, 8, 9]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("neuron-tp-")]


def _without_kernels(rank: int, world: int, port: int, out) -> None:
    _group(rank, world, port)
    comm = Collectives(world)
    how = comm.use_host_memory(cpu_kernels().mod if rank == 0 else None, 30.0)
    x = torch.full((2, 2), float(rank + 1))
    out.put((rank, (how, comm.all_reduce(x).tolist())))
    _leave()


def test_a_rank_that_cannot_join_sends_every_rank_to_gloo():
    got = _spawn(_without_kernels, 2)
    assert got[0][0] == "gloo (no shared memory: another rank could not map it)"
    assert got[1][0] == "gloo (no shared memory: the CPU kernels are not built)"
    assert got[0][1] == got[1][1] == [[3.0, 3.0], [3.0, 3.0]]


def _late(rank: int, world: int, port: int, out) -> None:
    _group(rank, world, port)
    comm = Collectives(world)
    comm.use_host_memory(cpu_kernels().mod, 30.0)
    comm.host.timeout_ms = 500
    t0 = time.monotonic()
    if rank == 0:
        try:
            comm.all_reduce(torch.ones(4))
            outcome = "returned"
        except RuntimeError as exc:
            outcome = str(exc)
    else:
        time.sleep(3)  # never arrives in time
        outcome = "slept"
    out.put((rank, (outcome, time.monotonic() - t0)))
    _leave()


def test_a_rank_that_never_arrives_fails_the_collective_within_its_deadline():
    got = _spawn(_late, 2)
    outcome, seconds = got[0]
    assert outcome == "a rank of the group did not reach the collective in time" and 0.4 < seconds < 2.5


def _elsewhere(rank: int, world: int, port: int, out) -> None:
    if rank == 1:
        host_collectives.host_id = lambda: "another boot:1"
    _group(rank, world, port)
    comm = Collectives(world)
    out.put((rank, comm.use_host_memory(cpu_kernels().mod, 30.0)))
    _leave()


def test_ranks_on_other_hosts_use_gloo_and_a_network_namespace_is_another_host():
    got = _spawn(_elsewhere, 2)
    assert got[0] == "gloo (no shared memory: another rank could not map it)"
    assert got[1] == "gloo (no shared memory: cannot open the segment: rank 0 is on another host (or network namespace))"
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("neuron-tp-")]
    if netns.why_not() is not None:
        pytest.skip(netns.why_not())
    name = f"nrnhost{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        there = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c",
                                "from neuron.models.host_collectives import host_id; print(host_id())"],
                               capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)
    here = host_collectives.host_id()
    assert there.split(":")[0] == here.split(":")[0] and there != here


def _dies_in_set_up(rank: int, world: int, port: int, out) -> None:
    _group(rank, world, port)
    if rank == 1:
        os._exit(3)  # gone before the set-up's broadcast
    try:
        Collectives(world).use_host_memory(cpu_kernels().mod, 30.0)
        outcome = "set up"
    except RuntimeError as exc:
        outcome = f"failed: {type(exc).__name__}"
    out.put((rank, (outcome, [f for f in os.listdir("/dev/shm") if f.startswith("neuron-tp-")])))
    # As a rank leaves (rank/process.py): its gloo threads, whose peer is gone, are not joined
    # (their destructors can abort the process: seen once under load).
    out.close()
    out.join_thread()
    os._exit(0)


def test_a_rank_lost_during_the_set_up_fails_it_and_leaves_no_segment():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29000 + (os.getpid() + 7) % 2000
    procs = [ctx.Process(target=_dies_in_set_up, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    rank, (outcome, segments) = out.get(timeout=120)
    for p in procs:
        p.join(60)
    assert rank == 0 and outcome.startswith("failed: "), outcome
    assert segments == [] and [p.exitcode for p in procs] == [0, 3]


@pytest.mark.parametrize("level", [level.name for level in isa.runnable()])
def test_every_kernel_level_meets_publishes_and_gives_up_in_time(level):
    """``arrive_and_wait`` of each instruction-set level this CPU runs: it publishes the round,
    returns once every counter has it, and fails by its deadline when one never does."""
    try:
        mod = load_level(level).mod
    except KernelUnavailable as exc:
        pytest.skip(str(exc))
    counters = torch.zeros(3 * 8, dtype=torch.int64)  # three counters, 64 bytes apart
    counters[8] = 5
    counters[16] = 7
    mod.arrive_and_wait(counters.data_ptr(), 0, 3, 5, 1000)
    assert counters[0].item() == 5
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not reach the collective in time"):
        mod.arrive_and_wait(counters.data_ptr(), 0, 3, 6, 200)  # rank 1 is still at 5
    assert 0.15 < time.monotonic() - t0 < 5 and counters[0].item() == 6
    with pytest.raises(RuntimeError, match="bad rank or round"):
        mod.arrive_and_wait(counters.data_ptr(), 3, 3, 1, 10)
