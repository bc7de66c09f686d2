"""ModelHandle: one model as the registry keeps it (its entry, files, devices, engine, rank
group, status) and as ``GET /models`` describes it."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from .config import ModelEntry
from .engine.client import LocalEngine
from .engine.engine import Engine
from .loader.spec import ModelSpec
from .rankgroup import RankGroup


@dataclass
class ModelHandle:
    id: str
    entry: ModelEntry
    spec: ModelSpec
    devices: list[str]
    dtype: str
    max_len: int
    engine: Engine
    status: str = "loading"
    group: RankGroup | None = None
    error: str | None = None
    shard_bytes: list[int] = field(default_factory=list)
    kv_bytes: list[int] = field(default_factory=list)
    state_bytes: list[int] = field(default_factory=list)  # per rank: the recurrent layers' state slots
    loading: RankGroup | None = None  # the group being loaded, while it is
    graphs: list[int] = field(default_factory=list)
    packing: str = ""  # rank 0's account of how its projections are stored
    load_seconds: float = 0.0
    recoveries: int = 0
    host_bytes: list[int] = field(default_factory=list)  # per rank: its host tier of the prefix cache
    host_block_bytes: int = 0  # one block of it, every rank's share together
    cpu_isa: str | None = None  # the CPU kernels' level the ranks run ("none": no kernels); None on GPUs
    client: LocalEngine = field(init=False)  # its engine as this process's HTTP side uses it

    def __post_init__(self) -> None:
        self.client = LocalEngine(self.engine, self.id)

    @property
    def packed(self) -> bool:
        """Quantized weights stay packed: on the CPU (the GPU has no packed kernel yet)."""
        return self.devices[0] == "cpu" and bool(self.entry.quantize or self.spec.quantized)

    @property
    def weight_format(self) -> str:
        """What the shard holds: "gguf:Q4_1+Q8_0", "q8_0 (in situ from safetensors:bf16)"."""
        fmt = self.spec.weight_format
        if self.entry.quantize and self.spec.quantized:
            fmt = f"{fmt} (kept; any float projection {self.entry.quantize} in situ)"
        elif self.entry.quantize:
            fmt = f"{self.entry.quantize} (in situ from {fmt})"
        if (self.entry.quantize or self.spec.quantized) and not self.packed:
            fmt += f", dequantized to {self.dtype}"
        return fmt

    def telemetry(self) -> list[dict]:
        """Each rank's device, as its last heartbeat told."""
        if self.group is None:
            return []
        return [{"rank": rank, **msgspec.structs.asdict(t)} for rank, t in sorted(self.group.telemetry.items())]

    def describe(self) -> dict:
        stats = self.engine.stats()
        z = self.engine.sizing
        return {
            "id": self.id, "status": self.status, "error": self.error, "format": self.spec.files.format,
            "family": self.spec.config.family, "capabilities": ["text"] + (["vision"] if self.spec.config.vision else []),
            "image_encodes": stats.image_encodes, "image_reuses": stats.image_reuses, "devices": self.devices, "tensor_parallel": self.entry.tensor_parallel,
            "pipeline_parallel": self.entry.pipeline_parallel,
            "dtype": self.dtype, "max_model_len": self.max_len, "max_slots": self.entry.max_slots,
            "weight_format": self.weight_format, "packing": self.packing, "cpu_isa": self.cpu_isa,
            "shard_bytes": self.shard_bytes, "load_seconds": round(self.load_seconds, 3),
            "recoveries": self.recoveries,
            "pids": self.group.pids if self.group else [], "epoch": self.group.epoch if self.group else None,
            "running": stats.running, "waiting": stats.waiting, "slots_used": stats.slots_used,
            "dropped_frames": self.group.dropped if self.group else 0,
            "load_progress_bytes": sum(self.loading.loaded_bytes.values()) if self.loading else None,
            "steps": stats.steps, "kv_blocks": stats.kv_blocks, "block_size": self.entry.block_size, "kv_usage": round(stats.kv_usage, 4),
            "kv_bytes": self.kv_bytes, "cuda_graphs": self.graphs, "preemptions": stats.preemptions,
            "max_batch_tokens": z.max_batch_tokens, "prefill_chunk": z.prefill_chunk,
            "prefill_chunk_decoding": z.prefill_chunk_decoding, "steps_in_flight": z.steps_in_flight,
            "chunk_beside_decodes": z.step_budget.table() if z.step_budget else None,
            "prefix_caching": z.cache_key is not None and (not stats.state_slots or stats.state_snapshots > 0),
            "layer_types": counted(self.spec.config.layer_types or ["attention"] * self.spec.config.num_layers),
            "state_slots": stats.state_slots, "state_slots_used": stats.state_slots_used,
            "state_snapshots": stats.state_snapshots, "state_snapshots_used": stats.state_snapshots_used,
            "state_restores": stats.state_restores, "state_dtype": self.entry.state_dtype if stats.state_slots else None,
            "state_bytes": self.state_bytes,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_tiers": {"host": {"blocks": stats.host_blocks, "used": stats.host_used, "bytes": self.host_bytes,
                                            "hits": stats.host_hits, "offloaded": stats.host_offloaded,
                                            "restored": stats.host_restored,
                                            "offload_seconds": round(stats.host_offload_s, 4),
                                            "restore_seconds": round(stats.host_restore_s, 4),
                                            **({"snapshots_offloaded": stats.host_state_offloaded,
                                                "snapshots_restored": stats.host_state_restored}
                                               if stats.state_slots else {})},
                                   **({"disk": {"blocks": stats.disk_blocks, "used": stats.disk_used,
                                                "block_bytes": self.host_block_bytes, "hits": stats.disk_hits,
                                                "written": stats.disk_written, "read": stats.disk_read,
                                                "skipped": stats.disk_skipped}}
                                      if stats.disk_blocks else {})}
            if stats.host_blocks else {},
            "leader_ms_per_step": round(stats.leader_ms_per_step, 4), "step_ms": round(stats.step_ms, 3),
            "rank_host_ms_per_step": round(stats.rank_host_ms_per_step, 4),
            "rank_mask_wait_ms_per_step": round(stats.rank_mask_wait_ms_per_step, 4),
            "device_idle_ms_per_step": round(stats.device_idle_ms_per_step, 4),
            "speculative": {"method": self.entry.speculative.method, "tokens": self.entry.speculative.tokens,
                            "drafts": stats.spec_drafts, "draft_tokens": stats.spec_draft_tokens,
                            "accepted_tokens": stats.spec_accepted_tokens} if self.entry.speculative.method else None,
        }


def counted(kinds: list[str]) -> dict[str, int]:
    """How many layers of each kind, in the order they first come."""
    return {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
