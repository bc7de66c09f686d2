"""Sparse mixture-of-experts block (qwen3_moe). Experts are split across ranks; the router is
replicated, so every rank routes identically and one all-reduce sums the experts' outputs."""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from protocol import ModelConfig

from .layers import WeightSource
from .packed_linear import PackedLinear
from .sharding import ShardPlan
from .tp_linear import AnyLinear, Linear, column_parallel, packed_kernel_for, row_parallel

log = logging.getLogger("neuron.moe")


class SharedMlp(Protocol):
    """A shared expert: a SiLU MLP (``llama.Mlp``)."""
    gate_up: AnyLinear
    down: AnyLinear

    def __call__(self, x: torch.Tensor, ops: object) -> torch.Tensor: ...


class SparseMoe:
    """``shared_gate``: a shared expert's gate row, kept as the router's last row (one product
    gives both)."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, src: WeightSource, prefix: str, dtype: torch.dtype,
                 device: torch.device, shared_gate: torch.Tensor | None = None) -> None:
        self.cfg = cfg
        self.experts = plan.experts
        self.grouped_failed = False
        self.stacked: tuple[object, object] | None = None  # packed experts as kernels.moe_packed.PackedExperts
        router = src.get(f"{prefix}.gate.weight")
        self.router = (router if shared_gate is None else torch.cat([router, shared_gate.to(router.dtype)])).to(
            device, dtype)
        # Rows padded to a multiple of 16: for the shared gate's odd count cuBLAS picked an old
        # unaligned kernel, 90 us of a 4,096-token layer on an H200 (scripts/profile-step --chain).
        self.logits = self.router.shape[0]
        if self.router.is_cuda:
            self.router = torch.cat([self.router, self.router.new_zeros(-self.logits % 16, self.router.shape[1])])
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
            self.stacked = stack_packed(self.packed)
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
        """Whether the experts run in the grouped kernels (on a GPU, dense or stacked packed ones),
        which a CUDA graph can hold: the per-expert loop below cannot (its shapes follow the routing)."""
        dense = not self.packed and self.gate_up.is_cuda
        return (dense or self.stacked is not None) and len(self.experts) > 0 and not self.grouped_failed

    def __call__(self, x: torch.Tensor, ops: object = None, shared: SharedMlp | None = None) -> torch.Tensor:
        """The experts' weighted sum for each row of ``x``, plus the ``shared`` expert's MLP
        scaled by the sigmoid of its gate (the router's last logit) where there is one."""
        logits, top, E = F.linear(x, self.router)[:, :self.logits], self.cfg.num_experts_per_tok, self.cfg.num_experts
        moe = getattr(ops, "sparse_moe", None)
        if moe is not None and self.grouped:
            try:
                fused = _plain(shared)
                weights, chosen = ops.moe_route(logits, top, self.cfg.norm_topk_prob, x.dtype, E)
                gate_up, down = self.stacked or (self.gate_up, self.down)
                out = moe(x, weights, chosen, self.experts.start, gate_up, down, fused)
                return out if fused is not None or shared is None else out + self.shared_part(logits, x, shared, ops)
            except Exception as exc:  # noqa: BLE001 - a kernel this GPU's Triton cannot build
                log.warning("the grouped MoE kernel failed (%s); experts run one by one, without CUDA graphs", exc)
                self.grouped_failed = True
        weights, chosen = torch.topk(F.softmax(logits[:, :E], dim=-1, dtype=torch.float), top, dim=-1)
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
        return out if shared is None else out + self.shared_part(logits, x, shared, ops)

    def shared_part(self, logits: torch.Tensor, x: torch.Tensor, shared: SharedMlp, ops: object) -> torch.Tensor:
        return torch.sigmoid(logits[:, self.cfg.num_experts:]) * shared(x, ops)


def _plain(shared: SharedMlp | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A shared expert's gate/up and down weights where both are plain dense matrices without a
    bias (the decode kernels then run it beside the routed experts)."""
    if shared is None or not all(isinstance(lin, Linear) and lin.bias is None for lin in (shared.gate_up, shared.down)):
        return None
    return shared.gate_up.weight, shared.down.weight


def stack_packed(experts: list[tuple[AnyLinear, AnyLinear]]) -> tuple[object, object] | None:
    """The experts' packed gate/up and down matrices, on a GPU, stacked as the grouped kernels
    take them (``PackedExperts``; each expert's ``PackedLinear`` then holds views of the stack, so
    the bytes are kept once); None where they differ in shape, bits or scales, carry a bias or a
    column order, or are not packed groups (FP8): those run one by one."""
    stacks = []
    for which in (0, 1):
        lins = [pair[which] for pair in experts]
        first = lins[0]
        if not (isinstance(first, PackedLinear) and first.device.type == "cuda"):
            return None
        if not all(isinstance(lin, PackedLinear) and lin.bias is None and lin.perm is None and lin.bits == first.bits
                   and lin.u.shape == first.u.shape and lin.sm.shape == first.sm.shape
                   and lin.sm.dtype == first.sm.dtype for lin in lins):
            return None
        stacks.append(lins)
    from neuron.kernels.gpu import PackedExperts

    out = []
    for lins in stacks:
        u = torch.stack([lin.u for lin in lins])
        sm = torch.stack([lin.sm for lin in lins])
        for e, lin in enumerate(lins):
            lin.u, lin.sm = u[e], sm[e]
            lin.s, lin.m = lin.sm[..., 0], lin.sm[..., 1]
            lin.stacked = True
        out.append(PackedExperts(u, sm, lins[0].bits))
    return out[0], out[1]
