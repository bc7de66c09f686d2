"""A rank process: an asyncio loop for ZeroMQ I/O and heartbeats, and one device executor
thread that owns torch. Requests run on the thread strictly in arrival order; ``ping`` is
answered by the loop itself, so a rank busy in a long step still proves it is alive."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import zmq
import zmq.asyncio

import protocol as p
from protocol.sockets import CURVE_ENV, connect_dealer, rank_identity

from .deferred import Deferred

log = logging.getLogger("neuron.rank")

HEARTBEAT_S = 1.0
# A folder: the device thread runs under cProfile, written there as rank<N>.prof at shutdown
# (where a served rank's host time goes; scripts/profile-step profiles a bare runner).
PROFILE_ENV = "NEURON_RANK_PROFILE"


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the leader dies, even mid-collective."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class RankProcess:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank, self.world, self.epoch = args.rank, args.world, args.epoch
        self.ctx = zmq.asyncio.Context()
        keys = [os.environ.pop(name, "") for name in CURVE_ENV]
        curve = tuple(k.encode() for k in keys) if all(keys) else None
        self.sock = connect_dealer(self.ctx, args.endpoint, rank_identity(args.rank), curve)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"device-{args.rank}")
        # Waits for launched steps to finish on the device, in launch order, while the device
        # thread goes on to launch the next one.
        self.collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"collect-{args.rank}")
        self.worker = None
        self.parent = os.getppid()
        self.stopping = asyncio.Event()
        self.profile = None  # the device thread's cProfile (PROFILE_ENV)

    async def send(self, frame: p.Frame) -> None:
        await self.sock.send(p.encode(frame))

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # torch is imported on the device thread: it owns every tensor, even the first.
        from .worker import DeviceWorker
        self.worker = await loop.run_in_executor(
            self.executor, DeviceWorker, self.rank, self.world, self.args.device, self.args.allow_faults)
        if os.environ.get(PROFILE_ENV):
            import cProfile
            self.profile = cProfile.Profile()
            await loop.run_in_executor(self.executor, self.profile.enable)  # the device thread's own
        beat = asyncio.create_task(self._heartbeat())
        try:
            while not self.stopping.is_set():
                try:
                    data = await asyncio.wait_for(self.sock.recv(), timeout=HEARTBEAT_S)
                except asyncio.TimeoutError:
                    continue
                try:
                    await self._on_frame(data)
                except Exception:  # nothing a peer sends may take the rank down
                    log.exception("rank %d: failed to handle a frame", self.rank)
        finally:
            beat.cancel()
            # Flush what is queued (the ``bye``) before the process exits without joining threads.
            self.sock.close(linger=1000)
            self.ctx.term()
        return 0

    async def _on_frame(self, data: bytes) -> None:
        try:
            msg = p.decode_request(data)
        except p.FrameError as exc:
            log.warning("rank %d: dropped %s frame: %s", self.rank, exc.kind, exc.message)
            await self.send(p.Error(id=exc.id, epoch=exc.epoch, kind=exc.kind, message=exc.message))
            return
        if isinstance(msg, p.Ping):
            await self.send(p.Pong(id=msg.id, epoch=msg.epoch, rank=self.rank, world=self.world,
                                   device=self.args.device, pid=os.getpid()))
            return
        if isinstance(msg, p.StepMasks):  # the device thread may be waiting for it: not queued behind it
            try:
                self.worker.late_masks.put(msg)
            except ValueError as exc:  # its step then fails, for want of the masks
                log.warning("rank %d: dropped a step_masks frame: %s", self.rank, exc)
            return
        if isinstance(msg, p.Shutdown):
            await asyncio.get_running_loop().run_in_executor(self.executor, self.worker.close)
            if self.profile is not None:
                await asyncio.get_running_loop().run_in_executor(self.executor, self.profile.disable)
                self.profile.dump_stats(os.path.join(os.environ[PROFILE_ENV], f"rank{self.rank}.prof"))
            await self.send(p.Bye(id=msg.id, epoch=msg.epoch))
            self.stopping.set()
            return
        future = asyncio.get_running_loop().run_in_executor(self.executor, self.worker.handle, msg)
        future.add_done_callback(self._reply_when_done)

    def _reply_when_done(self, future: asyncio.Future) -> None:
        reply = future.result()
        if isinstance(reply, Deferred):
            waited = asyncio.get_running_loop().run_in_executor(self.collector, reply.wait)
            waited.add_done_callback(self._reply_when_done)
        elif reply is not None:
            asyncio.ensure_future(self.send(reply))

    async def _heartbeat(self) -> None:
        while True:
            if os.getppid() != self.parent:
                log.error("rank %d: leader is gone, exiting", self.rank)
                os._exit(3)
            busy = self.worker.busy_step if self.worker else -1
            loaded = self.worker.loaded_bytes if self.worker else 0
            telemetry = self.worker.telemetry.sample() if self.worker else None
            await self.send(p.Heartbeat(id=0, epoch=self.epoch, rank=self.rank, busy_step=busy, loaded_bytes=loaded,
                                        telemetry=telemetry))
            await asyncio.sleep(HEARTBEAT_S)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m neuron.rank")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--epoch", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--allow-faults", action="store_true")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    # Three threads share the GIL (socket loop, device, collector): hand it over quickly, so the
    # device thread launches the next step while the last one runs.
    sys.setswitchinterval(2e-4)
    # The leader decides when ranks stop: a signal to the whole process group (Ctrl-C, systemd's
    # stop, kill -TERM -PGID) must leave them serving the requests the leader drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    proc = RankProcess(args)
    try:
        import uvloop
        code = uvloop.run(proc.run())
    except ImportError:
        code = asyncio.run(proc.run())
    # The device thread may sit in a collective that will never finish: do not join it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
