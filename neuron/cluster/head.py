"""The head's side of the other nodes: who is there, what their files are, what they should run.

The head binds one CURVE socket at ``master_addr:master_port``; only sockets holding the group
key complete the handshake, so nothing from a peer without it is ever read. Each node
supervisor says hello twice a second; the head answers each with the node's orders (the rank
groups it should run, the models it should find). A rank group with ranks on other nodes asks
this directory to ``join`` them: wait for the nodes, check their version and files, order their
ranks spawned; and ``release`` them when the group ends.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio

from protocol import cluster as c

from ..config import ClusterConfig
from ..errors import GroupFailed
from .fingerprint import VERSION
from .keys import GroupKey

log = logging.getLogger("neuron.cluster")

ORDERS_EVERY_S = 0.5
MAX_FRAME_BYTES = 1 << 20


class JoinFailed(GroupFailed):
    """The other nodes could not be gathered or do not match the head; the message says which."""


def keep_alive(sock: zmq.Socket, deadline_s: float) -> None:
    """ZeroMQ's own heartbeats on a socket between hosts: a cut link is noticed (and redialled)
    within the deadline instead of when TCP gives up, minutes later."""
    ivl = max(200, int(deadline_s * 1000 / 4))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(deadline_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(deadline_s * 1000))
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    # Hellos and orders are a few KB: a frame past this is dropped with its connection, unread.
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)


def node_identity(node_rank: int) -> bytes:
    return f"node-{node_rank}".encode()


@dataclass
class Node:
    hello: c.NodeHello
    last_seen: float
    seen_exits: set[tuple[int, int]] = field(default_factory=set)


@dataclass
class Placement:
    """A rank group's ranks on other nodes, and what to call when one of them exits."""

    order: c.GroupOrder
    node_rank: int
    on_exit: Callable[[str], None]


class ClusterHead:
    def __init__(self, cfg: ClusterConfig, key: GroupKey, ctx: zmq.asyncio.Context, deadline_s: float) -> None:
        self.cfg, self.key, self.deadline_s = cfg, key, deadline_s
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.curve_server = True
        self.sock.curve_publickey, self.sock.curve_secretkey = key.server
        keep_alive(self.sock, deadline_s)
        # A host name (Slurm's, a LeaderWorkerSet's) is resolved once: sockets bind addresses.
        self.address = socket.gethostbyname(cfg.master_addr)
        self.sock.bind(f"tcp://{self.address}:{cfg.master_port}")
        self.nodes: dict[int, Node] = {}
        self.refused: dict[int, str] = {}
        self.placements: dict[int, list[Placement]] = {}  # by epoch
        self.wanted_models: set[str] = set()
        self.incarnation = secrets.token_hex(8)
        self._changed = asyncio.Event()
        self._tasks = [asyncio.create_task(self._receive(), name="cluster-recv"),
                       asyncio.create_task(self._send_orders(), name="cluster-orders")]

    @property
    def others(self) -> list[int]:
        return list(range(1, self.cfg.nnodes))

    def present(self, node_rank: int) -> bool:
        node = self.nodes.get(node_rank)
        return node is not None and time.monotonic() - node.last_seen < self.deadline_s

    def missing(self) -> list[int]:
        return [n for n in self.others if not self.present(n)]

    def describe(self) -> dict:
        now = time.monotonic()
        nodes = {}
        for n in range(self.cfg.nnodes):
            node = self.nodes.get(n)
            if n == 0:
                nodes["0"] = {"status": "head"}
            elif n in self.refused:
                nodes[str(n)] = {"status": "refused", "reason": self.refused[n]}
            elif node is None:
                nodes[str(n)] = {"status": "missing"}
            else:
                nodes[str(n)] = {"status": "ready" if self.present(n) else "missing",
                                 "last_seen_s": round(now - node.last_seen, 3), "running_epochs": node.hello.running}
        return {"nnodes": self.cfg.nnodes, "master": f"{self.cfg.master_addr}:{self.cfg.master_port}",
                "missing": self.missing(), "nodes": nodes}

    # ----------------------------------------------------------------------------- groups
    async def join(self, epoch: int, model: str, fingerprint: str, endpoint: str, world: int, local: int,
                   on_exit: Callable[[str], None]) -> dict[int, list[str]]:
        """Gather the other nodes for rank group ``epoch`` and order its ranks spawned there
        (node i runs ranks i*local .. (i+1)*local-1). Returns each remote rank's model paths."""
        self.wanted_models.add(model)
        self._changed.set()
        deadline = time.monotonic() + self.cfg.join_timeout_s
        files: dict[int, c.ModelFiles] = {}
        while True:
            for n in self.others:
                node = self.nodes.get(n)
                found = next((m for m in node.hello.models if m.model == model), None) if self.present(n) else None
                if found is not None:
                    files[n] = found
                else:
                    files.pop(n, None)
            refused = {n: why for n, why in self.refused.items() if n in self.others}
            if refused:
                raise JoinFailed("; ".join(f"node {n} refused: {why}" for n, why in sorted(refused.items())))
            if len(files) == len(self.others):
                break
            if time.monotonic() > deadline:
                waiting = [n for n in self.others if n not in files]
                raise JoinFailed(f"node(s) {waiting} did not join within {self.cfg.join_timeout_s:.0f}s "
                                 f"(missing: {self.missing()})")
            await asyncio.sleep(0.1)
        for n, found in sorted(files.items()):
            node = self.nodes[n]
            if found.error:
                raise JoinFailed(f"node {n} cannot serve {model!r}: {found.error}")
            if found.fingerprint != fingerprint:
                raise JoinFailed(f"node {n} has other files for {model!r} than the head (config or tensors differ: "
                                 f"fingerprint {found.fingerprint} against {fingerprint})")
            if node.hello.local_ranks != local:
                raise JoinFailed(f"node {n} runs {node.hello.local_ranks} rank(s) per group, the head {local}")
        paths: dict[int, list[str]] = {}
        self.placements[epoch] = []
        for n in self.others:
            ranks = list(range(n * local, (n + 1) * local))
            order = c.GroupOrder(epoch=epoch, model=model, endpoint=endpoint, world=world, ranks=ranks)
            self.placements[epoch].append(Placement(order, n, on_exit))
            for r in ranks:
                paths[r] = files[n].paths
        self._changed.set()
        return paths

    def release(self, epoch: int) -> None:
        """The group ``epoch`` is over: its ranks on other nodes are to be stopped."""
        if self.placements.pop(epoch, None) is not None:
            self._changed.set()

    # ----------------------------------------------------------------------------- plumbing
    def _orders(self, node_rank: int) -> c.NodeOrders:
        if node_rank in self.refused:
            return c.NodeOrders(deadline_s=self.deadline_s, head=self.incarnation, refused=self.refused[node_rank])
        groups = [p.order for placements in self.placements.values() for p in placements if p.node_rank == node_rank]
        return c.NodeOrders(deadline_s=self.deadline_s, head=self.incarnation, groups=groups,
                            models=sorted(self.wanted_models))

    async def _send_orders(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), ORDERS_EVERY_S)
            except asyncio.TimeoutError:
                pass
            self._changed.clear()
            for n in list(self.nodes):
                try:
                    await self.sock.send_multipart([node_identity(n), c.encode(self._orders(n))], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # not connected now: it gets the next orders when it is

    async def _receive(self) -> None:
        while True:
            parts = await self.sock.recv_multipart()
            if len(parts) != 2:
                continue
            hello = c.decode(parts[1])
            if not isinstance(hello, c.NodeHello) or parts[0] != node_identity(hello.node_rank) \
                    or not 0 < hello.node_rank < self.cfg.nnodes:
                log.warning("dropped a frame from %r that is not a hello of a node of this group", parts[0][:32])
                continue
            self._on_hello(hello)

    def _on_hello(self, hello: c.NodeHello) -> None:
        n = hello.node_rank
        first = not self.present(n)
        node = self.nodes.setdefault(n, Node(hello, time.monotonic()))
        node.hello, node.last_seen = hello, time.monotonic()
        if hello.version != VERSION and n not in self.refused:
            self.refused[n] = f"it runs neuron {hello.version}, the head {VERSION}"
            log.error("node %d refused: %s", n, self.refused[n])
        if first:
            log.info("node %d joined (%d local rank(s), running epochs %s)", n, hello.local_ranks, hello.running)
            self._changed.set()
        for ex in hello.exits:
            if (ex.epoch, ex.rank) in node.seen_exits:
                continue
            node.seen_exits.add((ex.epoch, ex.rank))
            for placement in self.placements.get(ex.epoch, ()):
                if placement.node_rank == n:
                    placement.on_exit(f"rank {ex.rank} on node {n} exited with code {ex.code}")

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.sock.close(0)


@dataclass
class Remote:
    """The ranks of a group that run on other nodes: node i runs ranks i*local .. (i+1)*local-1,
    started by its supervisor when the head's directory orders them."""

    head: "ClusterHead"
    key: "GroupKey"
    model: str  # the model reference each node resolves for itself
    fingerprint: str  # of the head's files; every node's must equal it
    world: int
