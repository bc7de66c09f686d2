"""Starting a rank group's processes: the environment each rank starts with, and the handshake
that makes them one collective group (ping, init, an all-reduce of ones). ``RankGroup.start``'s."""

from __future__ import annotations

import os

import protocol as p
from protocol.sockets import CURVE_ENV

from .errors import GroupFailed
from .leader_sockets import free_port


def rank_env(backend: str, local_ranks: int, server_keys, client_keys) -> dict[str, str]:
    """A rank's environment: ours, the CURVE keys it talks with, and its OpenMP threads."""
    env = dict(os.environ)
    if server_keys and client_keys:
        env.update(zip(CURVE_ENV, (k.decode() for k in (server_keys[0], *client_keys))))
    if backend == "gloo":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_ranks)))
    else:  # a GPU rank's host work is launches: idle OpenMP threads would only spin beside it
        env.setdefault("OMP_NUM_THREADS", "4")
    return env


async def join_collective(group, backend: str) -> None:
    """Every rank answers a ping as itself, joins the collective group, and an all-reduce of ones
    over it gives the world size; GroupFailed otherwise."""
    pongs = await group.broadcast(lambda i: p.Ping(id=i, epoch=group.epoch), group.timeouts.control_s)
    for rank, pong in pongs.items():
        if not isinstance(pong, p.Pong) or pong.rank != rank or pong.world != group.world:
            raise GroupFailed(f"rank {rank} answered ping with {pong!r}")
    rendezvous = f"tcp://{group.host}:{free_port(group.host)}"
    await group.broadcast_each(lambda i, r: p.InitDist(
        id=i, epoch=group.epoch, backend=backend, rendezvous=rendezvous, world=group.world, rank=r,
        timeout_s=group.timeouts.control_s), group.timeouts.control_s)
    sums = await group.broadcast(lambda i: p.SanityCheck(id=i, epoch=group.epoch), group.timeouts.control_s)
    bad = {r: s.observed for r, s in sums.items() if s.observed != group.world}
    if bad:
        raise GroupFailed(f"sanity check failed: all-reduce of ones gave {bad}, expected {group.world}")
