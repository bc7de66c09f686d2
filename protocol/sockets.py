"""ZeroMQ helpers: the leader's ROUTER, a rank's DEALER, and the private runtime directory."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import zmq
import zmq.asyncio


def runtime_dir(base: str | None = None) -> Path:
    """A fresh directory only this user can enter (mode 0700), for ``ipc://`` endpoints."""
    path = Path(tempfile.mkdtemp(prefix="neuron-", dir=base))
    os.chmod(path, stat.S_IRWXU)
    return path


def ipc_endpoint(directory: Path, name: str) -> str:
    return f"ipc://{directory / name}"


# Environment variables that hand a rank its CURVE keys (never argv: argv is world-readable).
CURVE_ENV = ("NEURON_CURVE_SERVER_KEY", "NEURON_CURVE_PUBLIC_KEY", "NEURON_CURVE_SECRET_KEY")


def bind_router(ctx: zmq.asyncio.Context, endpoint: str,
                server_keys: tuple[bytes, bytes] | None = None) -> tuple[zmq.asyncio.Socket, str]:
    """Bind the leader's ROUTER; returns it with the endpoint actually bound. ``tcp://HOST``
    without a port takes a free one, and requires CURVE ``server_keys`` (public, secret)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # A send to a rank that is not (or no longer) connected raises instead of vanishing.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if endpoint.startswith("tcp://"):
        if server_keys is None:
            sock.close(0)
            raise ValueError("tcp:// rank endpoints need CURVE keys")
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = server_keys
        if endpoint.count(":") == 1:
            port = sock.bind_to_random_port(endpoint)
            return sock, f"{endpoint}:{port}"
    sock.bind(endpoint)
    return sock, endpoint


def connect_dealer(ctx: zmq.asyncio.Context, endpoint: str, identity: bytes,
                   curve: tuple[bytes, bytes, bytes] | None = None) -> zmq.asyncio.Socket:
    """A rank's DEALER; ``curve`` is (server public, own public, own secret) for tcp://."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    elif endpoint.startswith("tcp://"):
        sock.close(0)
        raise ValueError("tcp:// rank endpoints need CURVE keys")
    sock.connect(endpoint)
    return sock


def rank_identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


def identity_rank(identity: bytes) -> int | None:
    name = identity.decode(errors="replace")
    if name.startswith("rank-") and name[5:].isdigit():
        return int(name[5:])
    return None
