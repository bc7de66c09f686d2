"""Sparse mixture-of-experts block (qwen3_moe). Experts are split across ranks; the router is
replicated, so every rank routes identically and one all-reduce sums the experts' outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from protocol import ModelConfig

from .layers import WeightSource
from .sharding import ShardPlan


class SparseMoe:
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, src: WeightSource, prefix: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.experts = plan.experts
        self.router = src.get(f"{prefix}.gate.weight").to(device, dtype)
        inter = cfg.moe_intermediate_size
        if src.has(f"{prefix}.experts.gate_up_proj"):
            gate_up = src.get(f"{prefix}.experts.gate_up_proj", dim=0, part=plan.experts)
            self.gate, self.up = gate_up[:, :inter].to(device, dtype), gate_up[:, inter:].to(device, dtype)
            self.down = src.get(f"{prefix}.experts.down_proj", dim=0, part=plan.experts).to(device, dtype)
        else:
            def stack(name: str) -> torch.Tensor:
                return torch.stack([src.get(f"{prefix}.experts.{e}.{name}.weight") for e in plan.experts]).to(device, dtype)
            self.gate, self.up, self.down = stack("gate_proj"), stack("up_proj"), stack("down_proj")

    def tensors(self) -> list[torch.Tensor]:
        return [self.router, self.gate, self.up, self.down]

    def __call__(self, x: torch.Tensor, ops: object = None) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.cfg.num_experts_per_tok, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for local, expert in enumerate(self.experts):
            token, k = torch.where(chosen == expert)
            if token.numel() == 0:
                continue
            h = x[token]
            h = F.linear(F.silu(F.linear(h, self.gate[local])) * F.linear(h, self.up[local]), self.down[local])
            out.index_add_(0, token, h * weights[token, k, None])
        return out
