"""The prefix cache's tiers beyond the ranks' own memory, as a model's load sets them up: what
each rank is asked to hold (``LoadShard``) and what the leader plans with once the ranks have
answered (``LoadOk``): the host tier (``[cache] host_gb``) and the disk tier below it
(``disk_dir``, ``disk_gb``). docs/architecture.md#the-host-tier."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from neuron import __version__

log = logging.getLogger("neuron.registry")

RESTORE_BYTES = 64 << 20  # a step beside decodes restores this much a rank at most


@dataclass
class CacheConfig:
    """``[cache]``: the prefix cache's tiers beyond the rank's memory."""

    host_gb: float = 0.0  # host memory each model's host tier takes, its ranks together (pinned on a GPU); 0: none
    disk_dir: str = ""  # the disk tier below it: each model's files under here (made 0700); "": none
    disk_gb: float = 0.0  # disk each model's disk tier takes, its ranks together


def cache_refused(cache) -> str | None:
    """Why ``[cache]`` cannot be, if it cannot; the disk tier's directory
    is made (0700) here, at startup."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    if not 0 <= cache.host_gb <= 0.8 * memory:
        return f"cache.host_gb must be >= 0 and at most 80% of this host's {memory:.1f} GB of memory"
    if not cache.disk_dir and not cache.disk_gb:
        return None
    if cache.disk_gb <= 0 or not cache.disk_dir or not cache.host_gb:
        return ("cache.disk_dir and cache.disk_gb go together (a disk tier), and need cache.host_gb (blocks go "
                "to disk and come back through the host tier)")
    from neuron.runner.disk_tier import DiskTierRefused, private_dir

    try:
        private_dir(Path(cache.disk_dir).expanduser())
    except (DiskTierRefused, OSError) as exc:
        return f"cache.disk_dir: {exc}"
    return None


def shard_fields(cfg, handle, world: int) -> dict:
    """The tiers' fields of each rank's ``LoadShard``."""
    if handle.engine.sizing.cache_key is None:
        return {}
    fields = {"host_bytes": int(cfg.cache.host_gb * 1e9 / world)}
    if cfg.cache.disk_dir:
        fields.update(disk_dir=str(Path(cfg.cache.disk_dir).expanduser()),
                      disk_bytes=int(cfg.cache.disk_gb * 1e9 / world), disk_identity=identity(handle))
    return fields


def identity(handle) -> str:
    """What a block's K/V depends on beyond its tokens, so that a disk tier kept across restarts
    serves it only to the same computation: the prefix cache's key (the model, its weights'
    paths, dtype, tensor-parallel size, quantization), each weight file's size and modification
    time, the pipeline split, the block size, the recurrent state's dtype and this release (its
    kernels)."""
    files = []
    for path in handle.spec.files.paths:
        st = os.stat(path)
        files.append([str(path), st.st_size, st.st_mtime_ns])
    entry = handle.entry
    return json.dumps([handle.engine.sizing.cache_key, files, handle.dtype, entry.pipeline_parallel,
                       entry.block_size, entry.state_dtype, __version__])


def tiers_loaded(cfg, handle, oks: dict, state_slots: int) -> tuple[int, int, dict]:
    """From the ranks' ``LoadOk``: the host tier's slots, the blocks a step beside decodes
    restores, and the rest of ``HostPlanning.use_host``'s fields: the disk tier's files and the
    hashes every rank holds (oldest first), the host slots a state snapshot takes."""
    world = len(oks)
    host = min(ok.host_blocks for ok in oks.values())
    if cfg.cache.host_gb and handle.engine.sizing.cache_key is not None and not host:
        log.warning("%s: no host tier (cache.host_gb %g): %s", handle.id, cfg.cache.host_gb,
                    "less than two of its state snapshots" if state_slots else "less than one KV block")
    per_block = [ok.kv_bytes // (ok.kv_blocks + 1) for _, ok in sorted(oks.items())]
    handle.host_bytes = [oks[r].host_blocks * per_block[r] for r in range(world)]
    handle.host_block_bytes = sum(per_block)
    disk = min(ok.disk_blocks for ok in oks.values()) if host else 0
    everywhere = set.intersection(*(set(ok.disk_hashes) for ok in oks.values())) if disk else set()
    hashes = [h for h in oks[0].disk_hashes if h in everywhere]
    if disk:
        log.info("%s: disk tier of %d blocks; %d kept from before", handle.id, disk, len(hashes))
    elif host and cfg.cache.disk_dir and handle.engine.sizing.cache_key is not None:
        log.warning("%s: no disk tier: cache.disk_gb %g holds less than one KV block a rank", handle.id,
                    cfg.cache.disk_gb)
    tiers = {"disk_blocks": disk, "disk_hashes": hashes} if disk else {}
    if host and state_slots:
        tiers["state_pieces"] = max(ok.state_pieces for ok in oks.values())
    return host, RESTORE_BYTES // max(1, *per_block), tiers


# Host memory a rank gives back a second at least, its host tier's pages unlocked and unmapped
# (half what an H200 host did: docs/architecture.md#the-host-tier).
FREED_BYTES_S = 4e9


def leave_s(host_bytes: list[int], base: float) -> float:
    """How long a model's ranks, whose host tiers hold ``host_bytes`` each, may take to leave:
    ``base``, and the time that memory takes to go back to the host (a rank says bye once it has)."""
    return base + max(host_bytes, default=0) / FREED_BYTES_S
