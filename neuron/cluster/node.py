"""A node other than the head: no HTTP API, only a supervisor that runs this host's ranks for the
head's rank groups (docs/multihost.md).

It dials the head with the group key and says hello twice a second: its version, its ranks per
group, the files it found for the models the head asked about, and which of its ranks exited.
The head's orders say which groups to run: ranks of a new group are spawned (each dials the
group's socket with the group key), ranks of a group no longer ordered are killed, and when no
orders come for their deadline (the head is gone or cut off) every rank is killed, so none
holds a device for a head that will not come back. The supervisor itself keeps running and
redialling until it is stopped, or refused (another key, another version): then it exits 2.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol import cluster as c
from protocol.sockets import CURVE_ENV

from ..config import Config
from ..devices import choose_devices
from .fingerprint import VERSION, model_fingerprint
from .head import ORDERS_EVERY_S, keep_alive, node_identity
from .keys import GroupKey, read_key
from .netif import collective_env
from ..rank_forks import RankProc, spawn_rank, warm

log = logging.getLogger("neuron.node")

# Handshakes failed in a row, none succeeding, that mean the head does not take our key.
REFUSED_AFTER = 3
HANDSHAKE_FAILED = (zmq.Event.HANDSHAKE_FAILED_NO_DETAIL, zmq.Event.HANDSHAKE_FAILED_PROTOCOL,
                    zmq.Event.HANDSHAKE_FAILED_AUTH)


class Refused(Exception):
    pass


@dataclass
class Ranks:
    order: c.GroupOrder
    procs: dict[int, RankProc] = field(default_factory=dict)


class NodeSupervisor:
    def __init__(self, cfg: Config, key: GroupKey) -> None:
        self.cfg, self.key = cfg, key
        self.node_rank = cfg.cluster.node_rank
        entry = cfg.models[0]
        self.local = entry.tensor_parallel * entry.pipeline_parallel // cfg.cluster.nnodes
        self.devices = choose_devices(entry.device, self.local, entry.devices)
        self.deadline_s = cfg.timeouts.heartbeat_timeout_s
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, node_identity(self.node_rank))
        self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = key.client
        keep_alive(self.sock, self.deadline_s)
        self.monitor = self.sock.get_monitor_socket()
        self.head = f"{cfg.cluster.master_addr}:{cfg.cluster.master_port}"
        self.models: dict[str, c.ModelFiles] = {}
        self._resolving: set[str] = set()
        self.groups: dict[int, Ranks] = {}
        self.exits: list[c.RankExit] = []
        self.last_orders = time.monotonic()
        self.head_incarnation = ""
        self.env = {**os.environ, **dict(zip(CURVE_ENV, (k.decode() for k in key.client)))}
        for name, value in collective_env(cfg.cluster.master_addr).items():
            self.env.setdefault(name, value)

    async def run(self, stop: asyncio.Event) -> int:
        if any(d == "cpu" for d in self.devices):  # torch imported for the ranks while the node dials the head
            warm()
        self.sock.connect(f"tcp://{self.head}")
        log.info("node %d: dialling the head at %s (%d rank(s) per group on %s)", self.node_rank, self.head,
                 self.local, self.devices)
        self._resolve(self.cfg.models[0].model)
        tasks = [asyncio.create_task(t) for t in (self._hello(), self._orders(), self._watch_handshakes(),
                                                  self._watch_head())]
        stopped = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopped and task.exception() is not None:
                    raise task.exception()
            return 0
        except Refused as exc:
            print(f"neuron: node {self.node_rank} was refused by the head at {self.head}: {exc}", file=sys.stderr)
            return 2
        finally:
            for task in (*tasks, stopped):
                task.cancel()
            await self._kill_all("the node supervisor is stopping")
            self.monitor.close(0)
            self.sock.close(0)
            self.ctx.term()

    # ----------------------------------------------------------------------------- head traffic
    async def _hello(self) -> None:
        while True:
            exits, self.exits = self.exits[-64:], self.exits[-64:]
            hello = c.NodeHello(node_rank=self.node_rank, version=VERSION, local_ranks=self.local,
                                models=list(self.models.values()),
                                running=sorted(e for e, g in self.groups.items() if g.procs), exits=exits)
            try:
                await self.sock.send(c.encode(hello), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # not connected: the next hello goes when it is
            await asyncio.sleep(ORDERS_EVERY_S)

    async def _orders(self) -> None:
        while True:
            orders = c.decode(await self.sock.recv())
            if not isinstance(orders, c.NodeOrders):
                continue
            if orders.refused:
                raise Refused(orders.refused)
            if orders.head != self.head_incarnation:  # a new head: its epochs are not the old one's
                log.info("node %d: joined the head at %s", self.node_rank, self.head)
                await self._kill_all("the head restarted")
                self.groups.clear()
                self.exits.clear()
                self.head_incarnation = orders.head
            self.last_orders, self.deadline_s = time.monotonic(), orders.deadline_s
            for model in orders.models:
                self._resolve(model)
            await self._reconcile(orders.groups)

    async def _watch_handshakes(self) -> None:
        failed = 0
        while True:
            event = zmq.Event(parse_monitor_message(await self.monitor.recv_multipart())["event"])
            if event == zmq.Event.HANDSHAKE_SUCCEEDED:
                failed = 0
            elif event in HANDSHAKE_FAILED:
                failed += 1
                if failed >= REFUSED_AFTER:
                    raise Refused(f"{failed} handshakes failed in a row: this node's group key is not the "
                                  "head's (copy the head's key file, written by `neuron keygen`)")

    async def _watch_head(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            silent = time.monotonic() - self.last_orders
            if silent > self.deadline_s and any(g.procs for g in self.groups.values()):
                await self._kill_all(f"no orders from the head for {silent:.1f}s")

    # ----------------------------------------------------------------------------- models, ranks
    def _resolve(self, model: str) -> None:
        if model in self.models or model in self._resolving:
            return
        self._resolving.add(model)

        def find() -> c.ModelFiles:
            from ..loader.spec import load_spec

            try:
                spec = load_spec(model, hf_cache=self.cfg.runtime.hf_cache or None, roots=self.cfg.server.model_roots)
                return c.ModelFiles(model=model, fingerprint=model_fingerprint(spec),
                                    paths=[str(p) for p in spec.files.paths])
            except Exception as exc:  # told to the head, which names it when it refuses the load
                return c.ModelFiles(model=model, error=f"{type(exc).__name__}: {exc}"[:500])

        async def resolve() -> None:
            found = await asyncio.to_thread(find)
            self.models[model] = found
            self._resolving.discard(model)
            log.info("node %d: %s: %s", self.node_rank, model, found.error or f"fingerprint {found.fingerprint}")

        asyncio.get_running_loop().create_task(resolve())

    async def _reconcile(self, orders: list[c.GroupOrder]) -> None:
        wanted = {o.epoch: o for o in orders}
        for epoch in [e for e in self.groups if e not in wanted]:
            await self._kill(self.groups.pop(epoch), "its group ended")
        for epoch, order in wanted.items():
            if epoch not in self.groups:
                self.groups[epoch] = ranks = Ranks(order)
                for device, rank in zip(self.devices, order.ranks):
                    await self._spawn(ranks, rank, device)

    async def _spawn(self, ranks: Ranks, rank: int, device: str) -> None:
        o = ranks.order
        args = ["--endpoint", o.endpoint, "--rank", str(rank), "--world", str(o.world), "--epoch", str(o.epoch),
                "--device", device]
        env = dict(self.env)
        if device == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.local)))
        proc = await spawn_rank(args, env, device)
        ranks.procs[rank] = proc
        log.info("node %d: started rank %d of epoch %d (pid %d) on %s", self.node_rank, rank, o.epoch, proc.pid, device)

        async def watch() -> None:
            code = await proc.wait()
            if ranks.procs.get(rank) is proc:  # not killed by us
                del ranks.procs[rank]
                self.exits.append(c.RankExit(epoch=o.epoch, rank=rank, code=code))
                log.warning("node %d: rank %d of epoch %d exited with code %d", self.node_rank, rank, o.epoch, code)

        asyncio.get_running_loop().create_task(watch())

    async def _kill(self, ranks: Ranks, why: str) -> None:
        procs, ranks.procs = ranks.procs, {}
        if procs:
            log.info("node %d: stopping epoch %d's rank(s) %s: %s", self.node_rank, ranks.order.epoch,
                     sorted(procs), why)
        for proc in procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
        for proc in procs.values():
            await proc.wait()

    async def _kill_all(self, why: str) -> None:
        for ranks in list(self.groups.values()):
            await self._kill(ranks, why)


def run_node(cfg: Config) -> int:
    """``neuron serve --node-rank i`` (i >= 1): supervise this host's ranks until stopped."""
    from .keys import GroupKeyError

    try:
        key = read_key(cfg.cluster.group_key, head=False)
    except GroupKeyError as exc:
        print(f"neuron: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await NodeSupervisor(cfg, key).run(stop)

    return asyncio.run(main())
