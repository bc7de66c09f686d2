"""The vocabulary-parallel embedding and LM head: each rank holds an equal share of the vocabulary
rows (the last share zero-padded); a lookup sums the ranks' rows (only the owner's is non-zero),
the logits are gathered across ranks."""

from __future__ import annotations

import torch

from protocol import ModelConfig

from .layers import Collectives, WeightSource
from .sharding import ShardPlan
from .tp_linear import AnyLinear, Linear, column_parallel


class VocabParallel:
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, src: WeightSource, prefix: str, dtype: torch.dtype,
                 device: torch.device, comm: Collectives) -> None:
        self.cfg, self.plan, self.dtype, self.device, self.comm = cfg, plan, dtype, device, comm
        rows = range(plan.vocab.start, min(plan.vocab.stop, cfg.vocab_size))
        self.embed = self._shard(src, f"{prefix}.embed_tokens.weight", rows)
        if cfg.tie_word_embeddings or not src.has("lm_head.weight"):
            self.lm_head = self.embed
        else:
            self.lm_head = self._shard(src, "lm_head.weight", rows)

    def _shard(self, src: WeightSource, name: str, rows: range) -> AnyLinear:
        """This rank's vocabulary rows, zero-padded to the common shard length."""
        if not len(rows):
            return Linear(torch.zeros(len(self.plan.vocab), self.cfg.hidden_size, device=self.device, dtype=self.dtype))
        return column_parallel(src, [(name, rows)], dtype=self.dtype, device=self.device, rows_to=len(self.plan.vocab))

    def linears(self) -> list[AnyLinear]:
        return [self.embed] + ([] if self.lm_head is self.embed else [self.lm_head])

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.plan.world == 1:
            return self.embed.rows(ids)
        local = ids - self.plan.vocab.start
        inside = (local >= 0) & (local < len(self.plan.vocab))
        h = self.embed.rows(local.clamp(0, len(self.plan.vocab) - 1)) * inside[:, None].to(self.dtype)
        return self.comm.all_reduce(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits of ``h``, identical on every rank."""
        return self.comm.all_gather_last(self.lm_head(h, out_dtype=torch.float32))[:, : self.cfg.vocab_size]
