"""Sparse mixture-of-experts block (qwen3_moe). Experts are split across ranks; the router is
replicated, so every rank routes identically and one all-reduce sums the experts' outputs."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from protocol import ModelConfig

from .layers import WeightSource

log = logging.getLogger("neuron.moe")
from .tp_linear import AnyLinear, column_parallel, packed_kernel_for, row_parallel
from .sharding import ShardPlan


class SparseMoe:
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, src: WeightSource, prefix: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.experts = plan.experts
        self.grouped_failed = False
        self.router = src.get(f"{prefix}.gate.weight").to(device, dtype)
        inter = cfg.moe_intermediate_size
        self.inter = inter
        # packed experts (quantized groups or FP8): each one's gate/up and down as their linears
        self.packed: list[tuple[AnyLinear, AnyLinear]] = []
        first = f"{prefix}.experts.{plan.experts.start}.gate_proj.weight"
        readers = [getattr(src, r, None) for r in ("get_quant", "get_fp8")]  # packed groups, FP8
        if (len(plan.experts) and packed_kernel_for(device, dtype)
                and any(read is not None and read(first) is not None for read in readers)):
            def name(e: int, proj: str) -> str:
                return f"{prefix}.experts.{e}.{proj}_proj.weight"

            self.packed = [(column_parallel(src, [(name(e, "gate"), None), (name(e, "up"), None)], dtype=dtype,
                                            device=device),
                            row_parallel(src, [(name(e, "down"), None)], dtype=dtype, device=device))
                           for e in plan.experts]
            self.gate = self.up = self.down = self.gate_up = torch.empty(0)
        elif src.has(f"{prefix}.experts.gate_up_proj"):
            self.gate_up = src.get(f"{prefix}.experts.gate_up_proj", dim=0, part=plan.experts).to(device, dtype)
            self.down = src.get(f"{prefix}.experts.down_proj", dim=0, part=plan.experts).to(device, dtype)
        else:
            def stack(names: tuple[str, ...]) -> torch.Tensor:
                return torch.stack([torch.cat([src.get(f"{prefix}.experts.{e}.{n}.weight") for n in names])
                                    for e in plan.experts]).to(device, dtype)
            self.gate_up, self.down = stack(("gate_proj", "up_proj")), stack(("down_proj",))
        if not self.packed:  # gate and up of an expert stacked: the grouped kernel runs them as one
            self.gate, self.up = self.gate_up[:, :inter], self.gate_up[:, inter:]

    def tensors(self) -> list[torch.Tensor]:
        packed = [t for pair in self.packed for lin in pair for t in lin.tensors()]
        return [self.router, self.gate_up, self.down, *packed]

    @property
    def grouped(self) -> bool:
        """Whether the experts run in the grouped kernel (dense, on a GPU), which a CUDA graph can
        hold: the per-expert loop below cannot (its shapes follow the routing)."""
        return not self.packed and self.gate_up.is_cuda and len(self.experts) > 0 and not self.grouped_failed

    def __call__(self, x: torch.Tensor, ops: object = None) -> torch.Tensor:
        logits, top = F.linear(x, self.router), self.cfg.num_experts_per_tok
        moe = getattr(ops, "sparse_moe", None)
        if moe is not None and self.grouped:
            try:
                weights, chosen = ops.moe_route(logits, top, self.cfg.norm_topk_prob, x.dtype)
                return moe(x, weights, chosen, self.experts.start, self.gate_up, self.down)
            except Exception as exc:  # noqa: BLE001 - a kernel this GPU's Triton cannot build
                log.warning("the grouped MoE kernel failed (%s); experts run one by one, without CUDA graphs", exc)
                self.grouped_failed = True
        weights, chosen = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float), top, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for local, expert in enumerate(self.experts):
            token, k = torch.where(chosen == expert)
            if token.numel() == 0:
                continue
            h = x[token]
            if self.packed:
                gate_up, down = self.packed[local]
                gate, up = gate_up(h).split(self.inter, dim=-1)
                h = down(F.silu(gate) * up)
            else:
                h = F.linear(F.silu(F.linear(h, self.gate[local])) * F.linear(h, self.up[local]), self.down[local])
            out.index_add_(0, token, h * weights[token, k, None])
        return out
