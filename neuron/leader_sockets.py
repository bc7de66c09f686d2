"""The leader's sockets beside each group's ROUTER: the tap's read-only mirror of every frame,
and the CURVE gate that admits only the rank keys the leader handed out."""

from __future__ import annotations

import os
import socket
import time

import msgspec
import zmq
import zmq.asyncio


class TapMirror:
    """Publishes a copy of every frame on a PUB socket for ``scripts/neuron-tap``. Read-only:
    nothing that arrives on it is ever read."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        self.sock.bind(endpoint)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], 0o600)
        self._enc = msgspec.msgpack.Encoder()

    def publish(self, direction: str, model: str, epoch: int, rank: int, frame: bytes) -> None:
        envelope = {"t": time.time(), "dir": direction, "model": model, "epoch": epoch, "rank": rank, "frame": frame}
        try:
            self.sock.send_multipart([b"frame", self._enc.encode(envelope)], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self.sock.close(0)


class CurveGate:
    """The leader's ZAP handler for tcp:// rank endpoints: only the CURVE client keys the leader
    minted for its own ranks may connect."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        from zmq.auth.asyncio import AsyncioAuthenticator

        self.allowed: set[bytes] = set()
        self.auth = AsyncioAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve_callback(domain="*", credentials_provider=self)

    def allow(self, public_key: bytes) -> None:
        self.allowed.add(public_key)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed

    def stop(self) -> None:
        self.auth.stop()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
