"""The frames between the head and the node supervisors of other hosts (docs/multihost.md).

A node says who it is, what it runs and which of its ranks exited (``NodeHello``, twice a
second); the head answers with the whole of what the node should run (``NodeOrders``, as often).
Orders are a desired state, not commands: a node that missed some, or reconnected, converges on
the next one. Both are also the heartbeats: a node that hears no orders for ``deadline_s`` kills
its ranks (their head is gone), and the head counts a node silent that long as missing.
"""

from __future__ import annotations

from typing import Union

import msgspec


class ModelFiles(msgspec.Struct, array_like=True, frozen=True):
    """What a node found for a model id: its files' fingerprint (config, tensor names, dtypes and
    shapes) and where they are on that node; or why it could not find them."""

    model: str
    fingerprint: str = ""
    paths: list[str] = []
    error: str = ""


class RankExit(msgspec.Struct, array_like=True, frozen=True):
    epoch: int
    rank: int
    code: int


class NodeHello(msgspec.Struct, tag="node_hello", array_like=True, frozen=True):
    node_rank: int
    version: str
    local_ranks: int  # how many ranks this node runs for a group (its devices)
    models: list[ModelFiles] = []
    running: list[int] = []  # the epochs whose ranks run here now
    exits: list[RankExit] = []  # recent exits of ranks of ordered epochs


class GroupOrder(msgspec.Struct, array_like=True, frozen=True):
    epoch: int
    model: str
    endpoint: str  # the group's ROUTER on the head (tcp://, CURVE)
    world: int
    ranks: list[int]  # the global ranks this node runs


class NodeOrders(msgspec.Struct, tag="node_orders", array_like=True, frozen=True):
    deadline_s: float
    head: str  # this start of the head process: epochs count afresh when it changes
    groups: list[GroupOrder] = []
    models: list[str] = []  # model ids whose files the node should find and fingerprint
    refused: str = ""  # the head will not take this node (a version or model mismatch): it exits


ClusterFrame = Union[NodeHello, NodeOrders]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ClusterFrame)


def encode(frame: ClusterFrame) -> bytes:
    return _encoder.encode(frame)


def decode(data: bytes) -> ClusterFrame | None:
    """The frame, or None for bytes that are not one (dropped by the caller)."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return None
