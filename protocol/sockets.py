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


def bind_router(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # A send to a rank that is not (or no longer) connected raises instead of vanishing.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(endpoint)
    return sock


def connect_dealer(ctx: zmq.asyncio.Context, endpoint: str, identity: bytes) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


def rank_identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


def identity_rank(identity: bytes) -> int | None:
    name = identity.decode(errors="replace")
    if name.startswith("rank-") and name[5:].isdigit():
        return int(name[5:])
    return None
