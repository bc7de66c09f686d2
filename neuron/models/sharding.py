"""How a model is split over tensor-parallel ranks. Pure Python: the leader checks a plan
before it spawns anything, and every rank derives its own share from the same function.

A rank takes whole KV-head groups (with their query heads), as evenly as they go: 3 KV heads
over 2 ranks is 2+1. With more ranks than KV heads the query heads are split instead and each
rank holds (replicates) the KV heads its query heads read. MLP columns, experts and the
vocabulary are split as evenly as they go.

Packed (quantized) weights split their input columns (the attention output and MLP down
projections) only on whole quant groups of ``block`` columns: the MLP is then split in whole
groups, as evenly as they go (exact, the sizes just differ by a group), and a head split whose
columns cut a group is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import ModelConfig


class ShardingError(ValueError):
    """The model cannot be spread over this many ranks."""


def split_even(n: int, world: int, rank: int) -> range:
    """Rank's contiguous share of ``n`` items; the first ``n % world`` ranks get one more."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world: int
    q_heads: range
    kv_heads: range
    kv_of_q: tuple[int, ...]  # for each local query head, the index of its local KV head
    mlp: range
    experts: range
    vocab: range  # padded so that every rank's share has the same length (for all_gather)
    vocab_padded: int



def split_blocks(n: int, world: int, rank: int, block: int) -> range:
    """Like ``split_even``, in whole ``block``s (the last one may be short)."""
    blocks = split_even(-(-n // block), world, rank)
    return range(min(blocks.start * block, n), min(blocks.stop * block, n))


def plan_shard(cfg: ModelConfig, world: int, rank: int, block: int = 1) -> ShardPlan:
    if world < 1 or not 0 <= rank < world:
        raise ShardingError(f"rank {rank} is not in a group of {world}")
    if not 0 < cfg.num_kv_heads <= cfg.num_heads <= 1 << 16:
        raise ShardingError(f"implausible head counts: {cfg.num_heads} query, {cfg.num_kv_heads} KV")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ShardingError(f"{cfg.num_heads} query heads do not form groups over {cfg.num_kv_heads} KV heads")
    if world > cfg.num_heads:
        raise ShardingError(
            f"tensor_parallel={world} is more ranks than the model's {cfg.num_heads} attention heads"
        )
    group = cfg.num_heads // cfg.num_kv_heads
    if world <= cfg.num_kv_heads:
        kv = split_even(cfg.num_kv_heads, world, rank)
        q = range(kv.start * group, kv.stop * group)
    else:
        q = split_even(cfg.num_heads, world, rank)
        kv = range(q.start // group, (q.stop - 1) // group + 1)
    kv_of_q = tuple(h // group - kv.start for h in q)
    if 0 < cfg.intermediate_size < world:
        raise ShardingError(f"intermediate_size {cfg.intermediate_size} is smaller than tensor_parallel={world}")
    per_rank_vocab = -(-cfg.vocab_size // world)
    vocab = range(rank * per_rank_vocab, (rank + 1) * per_rank_vocab)
    experts = split_even(cfg.num_experts, world, rank) if cfg.num_experts else range(0)
    mlp = split_blocks(cfg.intermediate_size, world, rank, block)
    if block > 1 and world > 1:
        cols = range(q.start * cfg.head_dim, q.stop * cfg.head_dim)
        if cols.start % block or (cols.stop % block and cols.stop != cfg.num_heads * cfg.head_dim):
            raise ShardingError(
                f"tensor_parallel={world} gives rank {rank} attention-output columns {cols.start}..{cols.stop}, "
                f"which cut the packed weights' {block}-element quant groups; choose a tensor_parallel that "
                f"splits the {cfg.num_heads} heads of {cfg.head_dim} into multiples of {block} columns")
        if cfg.intermediate_size and not len(mlp):
            raise ShardingError(f"intermediate_size {cfg.intermediate_size} has fewer {block}-column quant groups "
                                f"than tensor_parallel={world} ranks")
    return ShardPlan(
        rank=rank,
        world=world,
        q_heads=q,
        kv_heads=kv,
        kv_of_q=kv_of_q,
        mlp=mlp,
        experts=experts,
        vocab=vocab,
        vocab_padded=per_rank_vocab * world,
    )


def sparse_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether layer ``index`` holds sparse experts (qwen3_moe) rather than a dense MLP."""
    return cfg.num_experts > 0 and index not in cfg.mlp_only_layers and (index + 1) % cfg.decoder_sparse_step == 0


def check_plan(cfg: ModelConfig, world: int, block: int = 1) -> list[ShardPlan]:
    """Every rank's plan, or ShardingError naming why the split is impossible."""
    return [plan_shard(cfg, world, r, block) for r in range(world)]
