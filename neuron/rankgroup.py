"""RankGroup: the leader's side of one model's rank processes.

It spawns the ranks, owns the ROUTER socket they connect to, correlates every reply with its
request by ``id`` (each wait has a deadline), and watches liveness (process exit, heartbeats).
The first failure fails the whole group: every pending call raises ``GroupFailed`` and the
processes are killed, so no collective a dead peer will never join can hold anything.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

import protocol as p
from protocol.sockets import bind_router, identity_rank, ipc_endpoint, rank_identity

from .config import TimeoutConfig
from .errors import GroupFailed, RankError
from .leader_sockets import CurveGate, TapMirror
from .rank_forks import RankProc, spawn_rank
from .rank_start import join_collective, rank_env

if TYPE_CHECKING:
    from .cluster.head import Remote

log = logging.getLogger("neuron.group")

# A watchdog check this late (seconds past its period) follows a stall of the leader's own loop.
WATCHDOG_S = 0.25  # how often the watchdog checks the ranks' heartbeats
WATCHDOG_LATE_S = 0.5

_epochs = itertools.count(1)
_ids = itertools.count(1)


@dataclass
class _Call:
    future: asyncio.Future
    waiting: set[int]
    replies: dict[int, p.Reply] = field(default_factory=dict)


class RankGroup:
    def __init__(self, *, model_id: str, devices: list[str], timeouts: TimeoutConfig, runtime_dir: Path,
                 ctx: zmq.asyncio.Context, tap: TapMirror | None = None, allow_faults: bool = False,
                 on_failure: Callable[["RankGroup", str], None] | None = None,
                 curve: "CurveGate | None" = None, remote: "Remote | None" = None, pipeline: int = 1) -> None:
        self.model_id = model_id
        self.devices = devices  # this host's ranks (0 .. len-1); the rest run on other nodes
        self.remote = remote
        self.world = remote.world if remote else len(devices)
        self.remote_paths: dict[int, list[str]] = {}
        # The rank that samples and answers steps: tensor rank 0 of the last pipeline stage.
        self.sampler = self.world - self.world // pipeline
        self.timeouts = timeouts
        self.epoch = next(_epochs)
        self.ctx = ctx
        self.tap = tap
        self.allow_faults = allow_faults
        self.on_failure = on_failure
        self.curve = curve
        if remote is not None:
            self.host = remote.head.address
            self.endpoint = f"tcp://{self.host}"
        else:
            self.host = "127.0.0.1"
            self.endpoint = "tcp://127.0.0.1" if curve else ipc_endpoint(runtime_dir, f"group-{self.epoch}.sock")
        self.sock: zmq.asyncio.Socket | None = None
        self.procs: list[RankProc] = []
        self.pids: list[int] = []
        self.last_seen: dict[int, float] = {}
        self.busy_step: dict[int, int] = {}
        self.loaded_bytes: dict[int, int] = {}  # per rank, from heartbeats: a load's progress
        self.telemetry: dict[int, p.Telemetry] = {}  # per rank, from heartbeats: its device
        self.dropped = 0
        self.failure: str | None = None
        self._calls: dict[int, _Call] = {}
        self._tasks: list[asyncio.Task] = []
        self._hello = asyncio.Event()
        self._closing = False

    # ----------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Spawn, connect, ping, init the collective group and check it; raises on failure."""
        server_keys = client_keys = None
        if self.remote is not None:  # every rank, here or on a node, holds the group key
            server_keys, client_keys = self.remote.key.server, self.remote.key.client[1:]
        elif self.curve is not None:
            server_keys, client_keys = zmq.curve_keypair(), zmq.curve_keypair()
            self.curve.allow(client_keys[0])
        self.sock, self.endpoint = bind_router(self.ctx, self.endpoint, server_keys)
        self._tasks.append(asyncio.create_task(self._receive(), name=f"recv-{self.model_id}"))
        backend = "nccl" if self.devices[0].startswith("cuda") else "gloo"
        env = rank_env(backend, len(self.devices), server_keys, client_keys)
        if self.remote is not None:
            from .cluster.netif import collective_env

            for name, value in collective_env(self.host).items():
                env.setdefault(name, value)
            r = self.remote  # its JoinFailed is a GroupFailed
            self.remote_paths = await r.head.join(self.epoch, r.model, r.fingerprint, self.endpoint, self.world,
                                                  len(self.devices), self.fail)
        for rank, device in enumerate(self.devices):
            args = ["--endpoint", self.endpoint, "--rank", str(rank), "--world", str(self.world),
                    "--epoch", str(self.epoch), "--device", device]
            if self.allow_faults:
                args.append("--allow-faults")
            proc = await spawn_rank(args, env, device)
            self.procs.append(proc)
            self.pids.append(proc.pid)
            self._tasks.append(asyncio.create_task(self._watch_exit(rank, proc)))
        log.info("%s: spawned %d rank(s) of %d here (epoch %d, pids %s, endpoint %s)", self.model_id, len(self.devices),
                 self.world, self.epoch, self.pids, self.endpoint)
        await self._wait_for(self._all_connected(), self.timeouts.spawn_s, "ranks to connect")
        self._tasks.append(asyncio.create_task(self._watchdog()))
        await join_collective(self, backend)

    async def _all_connected(self) -> None:
        while len(self.last_seen) < self.world:
            self._hello.clear()
            await self._hello.wait()

    async def load(self, msg_for: Callable[[int], p.LoadShard]) -> dict[int, p.LoadOk]:
        """Every rank loads its shard; a rank on another node reads the files where that node has them."""
        def shard(cid: int, rank: int) -> p.LoadShard:
            msg = msg_for(cid)
            paths = self.remote_paths.get(rank)
            return msg if paths is None else msgspec.structs.replace(msg, paths=paths)

        return await self.broadcast_each(shard, self.timeouts.load_s)

    async def send_step(self, step_id: int, seqs: list[p.StepSeq], forget_images: list[bytes] | None = None,
                        moves=None) -> Callable[[], Awaitable[p.StepResult]]:
        """Broadcast one step and return how to wait for its result (the sampling rank answers
        with tokens, the others only with errors). The caller may send the next step before waiting."""
        tokens = sum(len(s.tokens) for s in seqs)
        # A step may queue behind one other on the ranks (overlapped steps): its deadline covers both.
        deadline = 2 * (self.timeouts.step_base_s + self.timeouts.step_per_token_s * tokens)
        cid = next(_ids)
        call = self._open(cid, {self.sampler})
        moved = {"offload": moves.offload, "restore": moves.restore, "spill": moves.spill, "fetch": moves.fetch,
                 "disk_drop": moves.drop, "state_offload": moves.state_offload,
                 "state_restore": moves.state_restore} if moves else {}
        frame = p.encode(p.Step(id=cid, epoch=self.epoch, step_id=step_id, seqs=seqs,
                                forget_images=forget_images or [], **moved))
        for rank in range(self.world):
            await self._send(rank, frame)

        async def result() -> p.StepResult:
            replies = await self._await(cid, call, deadline, f"step {step_id}")
            reply = replies[self.sampler]
            if not isinstance(reply, p.StepResult):
                raise GroupFailed(f"rank {self.sampler} answered a step with {type(reply).__name__}")
            return reply

        return result

    def send_masks(self, step_id: int, slots: list[int], masks: list[bytes]) -> None:
        """The masks of a sent step's ``mask_later`` rows, to the sampling rank, each distinct
        one once (no reply; a group that failed drops them, its steps fail anyway)."""
        if self.failure is not None or self.sock is None:
            return
        distinct: dict[bytes, int] = {}
        which = [distinct.setdefault(mask, len(distinct)) for mask in masks]
        frame = p.encode(p.StepMasks(id=0, epoch=self.epoch, step_id=step_id, slots=slots, masks=list(distinct),
                                     which=which))
        sent = self.sock.send_multipart([rank_identity(self.sampler), frame])
        sent.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                               or self.fail(f"cannot send to rank {self.sampler}: {f.exception()}"))
        if self.tap is not None:
            self.tap.publish("send", self.model_id, self.epoch, self.sampler, frame)

    async def step(self, step_id: int, seqs: list[p.StepSeq]) -> p.StepResult:
        """Broadcast one step and wait for its result."""
        return await (await self.send_step(step_id, seqs))()

    async def free(self, slots: list[int]) -> None:
        await self.broadcast(lambda i: p.Free(id=i, epoch=self.epoch, slots=slots), self.timeouts.control_s)

    async def memory(self) -> dict[int, p.MemoryInfo]:
        return await self.broadcast(lambda i: p.Memory(id=i, epoch=self.epoch), self.timeouts.control_s)

    async def request(self, rank: int, frame_for: Callable[[int], p.Frame], timeout: float) -> p.Reply:
        cid = next(_ids)
        call = self._open(cid, {rank})
        frame = frame_for(cid)
        await self._send(rank, p.encode(frame))
        return (await self._await(cid, call, timeout, type(frame).__name__))[rank]

    async def broadcast(self, frame_for: Callable[[int], p.Frame], timeout: float) -> dict[int, p.Reply]:
        return await self.broadcast_each(lambda cid, rank: frame_for(cid), timeout)

    async def broadcast_each(self, frame_for: Callable[[int, int], p.Frame], timeout: float) -> dict[int, p.Reply]:
        """Send each rank its own frame (all under one id) and wait for every reply."""
        cid = next(_ids)
        call = self._open(cid, set(range(self.world)))
        name = "request"
        for rank in range(self.world):
            frame = frame_for(cid, rank)
            name = type(frame).__name__
            await self._send(rank, p.encode(frame))
        return await self._await(cid, call, timeout, name)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask every rank to leave, then make sure none is left."""
        self._closing = True
        if self.failure is None and self.sock is not None:
            async def all_exited() -> list[int]:
                return [await proc.wait() for proc in self.procs]

            byes = asyncio.ensure_future(self.broadcast(lambda i: p.Shutdown(id=i, epoch=self.epoch), timeout))
            exits = asyncio.ensure_future(all_exited())
            # Every rank saying bye, or every rank having exited, is a clean shutdown.
            await asyncio.wait({byes, exits}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            exited = exits.done() and all(code == 0 for code in exits.result())
            if not exited and not (byes.done() and byes.exception() is None):
                reason = byes.exception() if byes.done() else "timeout"
                log.warning("%s: shutdown was not clean: %s", self.model_id, reason)
            for task in (byes, exits):
                task.cancel()
        await self._reap(timeout)
        self._close_socket()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                try:
                    proc.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass

    async def _reap(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(proc.wait() for proc in self.procs)), timeout)
        except asyncio.TimeoutError:
            log.warning("%s: ranks did not exit in %.0fs, killing them", self.model_id, timeout)
        self.kill()
        await asyncio.gather(*(proc.wait() for proc in self.procs))

    def _close_socket(self) -> None:
        if self.remote is not None:
            self.remote.head.release(self.epoch)
        for task in self._tasks:
            task.cancel()
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        if self.endpoint.startswith("ipc://") and os.path.exists(self.endpoint[len("ipc://"):]):
            os.unlink(self.endpoint[len("ipc://"):])

    async def close_after_failure(self) -> None:
        self._closing = True
        self.kill()
        await self._reap(5.0)
        self._close_socket()

    # ----------------------------------------------------------------------------- failure
    def fail(self, reason: str) -> None:
        if self.failure is not None or self._closing:
            return
        self.failure = reason
        log.error("%s: rank group (epoch %d) failed: %s", self.model_id, self.epoch, reason)
        self.kill()
        if self.remote is not None:
            self.remote.head.release(self.epoch)
        for call in self._calls.values():
            if not call.future.done():
                call.future.set_exception(GroupFailed(reason))
        self._calls.clear()
        if self.on_failure is not None:
            self.on_failure(self, reason)

    async def _watch_exit(self, rank: int, proc: RankProc) -> None:
        code = await proc.wait()
        self.fail(f"rank {rank} (pid {proc.pid}) exited with code {code}")

    async def watchdog_wait(self) -> None:
        """The watchdog's wait between checks (a test stalls the loop inside it)."""
        await asyncio.sleep(WATCHDOG_S)

    async def _watchdog(self) -> None:
        woke = time.monotonic()
        while self.failure is None:
            await self.watchdog_wait()
            now, last = time.monotonic(), woke
            woke = now
            if now - last > WATCHDOG_S + WATCHDOG_LATE_S:
                # This loop did not run for a while (a long synchronous stretch, such as tokenizing a
                # huge prompt, or a starved CPU), and this check may run right after it, before the
                # loop has read the heartbeats that wait in the socket: a rank that beat all along
                # would look silent. Judge at the next check, which comes after a read.
                continue
            for rank in range(self.world):
                silent = now - self.last_seen.get(rank, now)
                if silent > self.timeouts.heartbeat_timeout_s:
                    self.fail(f"rank {rank} sent no heartbeat for {silent:.1f}s")
                    return

    # ----------------------------------------------------------------------------- plumbing
    def _open(self, cid: int, ranks: set[int]) -> _Call:
        if self.failure is not None:
            raise GroupFailed(self.failure)
        call = _Call(asyncio.get_running_loop().create_future(), set(ranks))
        self._calls[cid] = call
        return call

    async def _await(self, cid: int, call: _Call, timeout: float, what: str) -> dict[int, p.Reply]:
        try:
            return await asyncio.wait_for(asyncio.shield(call.future), timeout)
        except asyncio.TimeoutError:
            self.fail(f"no reply to {what} within {timeout:.1f}s")
            raise GroupFailed(self.failure or "timeout") from None
        finally:
            self._calls.pop(cid, None)

    async def _wait_for(self, aw, timeout: float, what: str) -> None:
        try:
            await asyncio.wait_for(aw, timeout)
        except asyncio.TimeoutError:
            self.fail(f"timed out after {timeout:.0f}s waiting for {what}")
            raise GroupFailed(self.failure or what) from None
        if self.failure is not None:
            raise GroupFailed(self.failure)

    async def _send(self, rank: int, frame: bytes) -> None:
        if self.failure is not None or self.sock is None:
            raise GroupFailed(self.failure or "group is closed")
        try:
            await self.sock.send_multipart([rank_identity(rank), frame])
        except zmq.ZMQError as exc:
            self.fail(f"cannot send to rank {rank}: {exc}")
            raise GroupFailed(self.failure or str(exc)) from None
        if self.tap is not None:
            self.tap.publish("send", self.model_id, self.epoch, rank, frame)

    async def _receive(self) -> None:
        assert self.sock is not None
        while True:
            parts = await self.sock.recv_multipart()
            if len(parts) != 2:
                self.dropped += 1
                continue
            identity, data = parts
            rank = identity_rank(identity)
            if rank is None or rank >= self.world:
                self.dropped += 1
                continue
            if self.tap is not None:
                self.tap.publish("recv", self.model_id, self.epoch, rank, data)
            try:
                reply = p.decode_reply(data)
            except p.FrameError as exc:
                self.dropped += 1
                log.warning("%s: undecodable frame from rank %d: %s", self.model_id, rank, exc.message)
                continue
            self._deliver(rank, reply)

    def _deliver(self, rank: int, reply: p.Reply) -> None:
        if reply.epoch != self.epoch:
            self.dropped += 1
            return
        if isinstance(reply, p.Heartbeat):
            self.last_seen[rank] = time.monotonic()
            self.busy_step[rank] = reply.busy_step
            self.loaded_bytes[rank] = reply.loaded_bytes
            if reply.telemetry is not None:
                self.telemetry[rank] = reply.telemetry
            self._hello.set()
            return
        self.last_seen[rank] = time.monotonic()
        call = self._calls.get(reply.id)
        if call is None or call.future.done():
            self.dropped += 1
            if isinstance(reply, p.Error):
                log.warning("%s: rank %d error outside any call: %s: %s", self.model_id, rank, reply.kind, reply.message)
            return
        if isinstance(reply, p.Error):
            call.future.set_exception(RankError(rank, reply.kind, reply.message))
            return
        if rank not in call.waiting:
            self.dropped += 1
            return
        call.waiting.discard(rank)
        call.replies[rank] = reply
        if not call.waiting:
            call.future.set_result(call.replies)
