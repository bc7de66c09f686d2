"""What one step moves between the ranks' caches and the prefix cache's host tier
(``host_tier.py``), and the tier's names of a state snapshot's pieces."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


def state_keys(h: bytes, pieces: int) -> list[bytes]:
    """The tier's names of the pieces of the state snapshot taken after the block hashed ``h``."""
    return [hashlib.blake2b(h + j.to_bytes(4, "little"), digest_size=16, person=b"neuron-state").digest()
            for j in range(pieces)]


@dataclass
class Moves:
    """What one step moves between the rank's cache and the host tier."""

    offload: list[tuple[int, int]] = field(default_factory=list)  # (block, slot)
    restore: list[tuple[int, int]] = field(default_factory=list)  # (slot, block)
    # (request, its run, table entry, hash) of each block restored: cached once the step answers
    cached: list[tuple] = field(default_factory=list)
    epoch: int = 0
    spill: list[tuple[int, bytes]] = field(default_factory=list)  # (slot, hash): written to disk
    fetch: list[tuple[bytes, int]] = field(default_factory=list)  # (hash, slot): read from disk
    drop: list[bytes] = field(default_factory=list)  # files deleted
    # a state snapshot's pieces, a host slot each: (state slot, piece, host slot) copied in, and back
    state_offload: list[tuple[int, int, int]] = field(default_factory=list)
    state_restore: list[tuple[int, int, int]] = field(default_factory=list)  # (host slot, state slot, piece)
