"""Ranks forked from a warm zygote (neuron/rank_forks.py, neuron/rank/zygote.py): a group's ranks
are children of one process that imported torch once, they answer as ranks started fresh do, and
the zygote's death takes its ranks with it and the model recovers on a new one. Where forks are
turned off (``NEURON_RANK_FORKS=0``) each rank is its own ``python -m neuron.rank``."""

from __future__ import annotations

import os
import signal
import time

import httpx

from conftest import DEFAULT_MODEL, alive, children_of, cmdline, greedy_ids, start_server

CONFIG = f"""
[[models]]
model = "{DEFAULT_MODEL}"
max_model_len = 512
max_slots = 2
"""


def describe(server) -> dict:
    return httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]


def zygotes(server) -> list[int]:
    return [pid for pid in children_of(server.proc.pid) if b"neuron.rank.zygote" in cmdline(pid).split(b"\0")]


def test_a_group_s_ranks_are_forked_by_one_zygote_and_its_death_is_recovered_from(server_tmp):
    server = start_server(server_tmp, config=CONFIG, args=["--tensor-parallel", "2"])
    try:
        want = greedy_ids(server, "What is the capital of France?")
        (zygote,) = zygotes(server)
        old = describe(server)
        assert sorted(children_of(zygote)) == sorted(old["pids"]) and len(old["pids"]) == 2
        os.kill(zygote, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = describe(server)
            if info["status"] == "loaded" and info["epoch"] != old["epoch"]:
                break
            time.sleep(0.2)
        assert info["epoch"] != old["epoch"] and info["recoveries"] == old["recoveries"] + 1, info
        assert not any(alive(pid) for pid in old["pids"])  # they died with it
        assert "rank zygote" in server.log() and "exited with code -9" in server.log()
        (again,) = zygotes(server)
        assert again != zygote and sorted(children_of(again)) == sorted(info["pids"])
        assert greedy_ids(server, "What is the capital of France?") == want
    finally:
        server.stop()


def test_with_forks_off_each_rank_is_its_own_python(server_tmp):
    server = start_server(server_tmp, config=CONFIG, args=["--tensor-parallel", "2"], env={"NEURON_RANK_FORKS": "0"})
    try:
        pids = describe(server)["pids"]
        assert not zygotes(server) and set(pids) <= set(children_of(server.proc.pid))
        assert all(b"neuron.rank" in cmdline(pid).split(b"\0") for pid in pids)
        assert len(greedy_ids(server, "What is the capital of France?")) > 0
    finally:
        server.stop()


def test_forked_ranks_over_tcp_get_their_curve_keys_through_the_zygote_s_pipe_only(server_tmp):
    server = start_server(server_tmp, config=CONFIG + '\n[runtime]\ntransport = "tcp"\n')
    try:
        assert len(greedy_ids(server, "What is the capital of France?")) > 0  # the keys reached the rank
        (zygote,) = zygotes(server)
        for pid in (zygote, *describe(server)["pids"]):  # in no process's starting environment
            assert b"CURVE" not in open(f"/proc/{pid}/environ", "rb").read()
    finally:
        server.stop()



def _pipes() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:"):
            out.add(target)
    return out


def test_a_zygote_started_before_the_loop_is_taken_over_or_replaced_when_it_died():
    """``neuron serve`` starts the zygote before its own imports (``prestart``); the first
    ``warm`` takes that process, or, if it has died meanwhile, closes its pipes and starts another."""
    import asyncio

    from neuron import rank_forks

    async def adopt() -> tuple[int, bool]:
        zygote, _ = rank_forks.warm()
        try:
            return zygote.proc.pid, zygote.alive
        finally:
            zygote.release()

    def early_zygote(known: set[int]) -> int:
        (pid,) = [p for p in children_of(os.getpid()) if b"neuron.rank.zygote" in cmdline(p).split(b"\0")
                  and p not in known]
        return pid

    def zygotes_here() -> set[int]:  # other tests' in this process may still be leaving
        return {p for p in children_of(os.getpid()) if b"neuron.rank.zygote" in cmdline(p).split(b"\0")}

    before, others = _pipes(), zygotes_here()
    rank_forks.prestart()
    first, opened = early_zygote(others), _pipes() - before
    assert opened
    assert asyncio.run(adopt()) == (first, True)
    assert _pipes() <= before  # released: its pipes closed (others' may close meanwhile)
    others, before = zygotes_here() - {first}, _pipes()
    rank_forks.prestart()
    dead, opened = early_zygote(others | {first}), _pipes() - before
    assert opened
    os.kill(dead, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while b"zygote" in cmdline(dead) and time.monotonic() < deadline:  # until it is a zombie
        time.sleep(0.05)
    pid, live = asyncio.run(adopt())
    assert live and pid not in (dead, first)
    assert _pipes() <= before  # the dead one's pipes were closed too, and its successor's


def test_a_rank_start_cancelled_while_its_pid_is_on_the_way_leaves_no_rank_and_the_next_start_its_own():
    """An unload cancels a load between the order to the zygote and the pid it reports: that
    rank is killed, and the next start gets the pid of the rank forked for it, not the other's."""
    import asyncio

    from neuron import rank_forks

    def args(rank: int) -> list[str]:  # an endpoint nobody binds: the rank waits on it until killed
        return ["--endpoint", f"ipc:///nonexistent-neuron-test/{os.getpid()}", "--rank", str(rank), "--world", "2",
                "--epoch", "1", "--device", "cpu"]

    async def race() -> tuple[set[int], int]:
        zygote, _ = rank_forks.warm()
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_")}
        try:
            first = asyncio.create_task(rank_forks.spawn_rank(args(0), env, "cpu"))
            await asyncio.sleep(0)  # its order is on the way to the zygote
            first.cancel()
            second = await rank_forks.spawn_rank(args(1), env, "cpu")
            try:
                deadline = time.monotonic() + 20
                while True:
                    ranks = {p for p in children_of(zygote.proc.pid) if alive(p)}
                    if ranks == {second.pid} or time.monotonic() > deadline:
                        return ranks, second.pid
                    await asyncio.sleep(0.05)
            finally:
                second.kill()
                await second.wait()
        finally:
            zygote.release()

    ranks, second = asyncio.run(race())
    assert ranks == {second}
