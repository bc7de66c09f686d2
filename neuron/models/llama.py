"""The llama-family decoder (llama 1/2/3, qwen3 with q/k norm, qwen3_moe with sparse experts),
holding one tensor-parallel rank's share of the weights.

Column-parallel: q/k/v (whole KV-head groups), gate/up. Row-parallel with one all-reduce each:
the attention output and the MLP (or MoE block). Embedding and LM head are vocab-parallel.
"""

from __future__ import annotations

import torch

from protocol import ModelConfig

from .interface import AttentionFn, AttentionShape, KvState, LayerState
from .layers import Collectives, WeightSource, rope_tables, unique_bytes
from .tp_linear import AnyLinear, ConcatLinear, column_parallel, row_parallel
from .vocab import VocabParallel
from .moe import SparseMoe
from .stages import Stage
from .ops import RopeTables, Rotary, TorchOps
from .sharding import ShardPlan, sparse_layer


def _rows(r: range, width: int) -> range:
    return range(r.start * width, r.stop * width)


class Attention:
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, src: WeightSource, prefix: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        hd = cfg.head_dim
        self.cfg = cfg
        self.n_q, self.n_kv = len(plan.q_heads), len(plan.kv_heads)

        def load(name: str, part: range, dim: int) -> torch.Tensor:
            return src.get(f"{prefix}.{name}", dim=dim, part=part).to(device, dtype)

        # q, k and v in one matrix: one GEMM instead of three
        qkv = [(f"{prefix}.{name}_proj", _rows(heads, hd))
               for name, heads in (("q", plan.q_heads), ("k", plan.kv_heads), ("v", plan.kv_heads))]
        bias = torch.cat([load(f"{n[len(prefix) + 1:]}.bias", r, 0) for n, r in qkv]) if cfg.attention_bias else None
        self.qkv = column_parallel(src, [(f"{n}.weight", r) for n, r in qkv], dtype=dtype, device=device, bias=bias)
        # The row-parallel output bias is added by one rank only, so the all-reduce counts it once.
        bo = None
        if plan.rank == 0 and src.has(f"{prefix}.o_proj.bias"):
            bo = load("o_proj.bias", range(cfg.hidden_size), 0)
        self.o = row_parallel(src, [(f"{prefix}.o_proj.weight", _rows(plan.q_heads, hd))], dtype=dtype,
                              device=device, bias=bo)
        if cfg.qk_norm:
            self.q_norm = src.get(f"{prefix}.q_norm.weight").to(device, dtype)
            self.k_norm = src.get(f"{prefix}.k_norm.weight").to(device, dtype)
        else:
            self.q_norm = self.k_norm = None
        groups = self.n_q // self.n_kv if self.n_q % self.n_kv == 0 else 0
        uniform = groups and plan.kv_of_q == tuple(i // groups for i in range(self.n_q))
        self.shape = AttentionShape(self.n_q, self.n_kv, hd, hd ** -0.5, plan.kv_of_q, groups if uniform else 0)

    def tensors(self) -> list[torch.Tensor]:
        norms = [self.q_norm, self.k_norm] if self.cfg.qk_norm else []
        return [*self.qkv.tensors(), *self.o.tensors(), *norms]

    def __call__(self, x: torch.Tensor, layer: int, positions: torch.Tensor, rope: RopeTables,
                 attend: AttentionFn) -> torch.Tensor:
        qkv = self.qkv(x).view(x.shape[0], self.n_q + 2 * self.n_kv, self.cfg.head_dim)
        return self.o(attend(layer, qkv, positions, Rotary(rope, self.q_norm, self.k_norm, self.cfg.rms_norm_eps)))


class Mlp:
    def __init__(self, src: WeightSource, prefix: str, part: range, dtype: torch.dtype, device: torch.device,
                 rank: int = 0) -> None:
        def pair(kind: str) -> torch.Tensor:
            return torch.cat([src.get(f"{prefix}.{name}.{kind}", dim=0, part=part).to(device, dtype)
                              for name in ("gate_proj", "up_proj")])

        self.width = len(part)
        # llama's mlp_bias: column-parallel biases are sliced; the row-parallel one is added by
        # rank 0 only, so the all-reduce counts it once.
        # gate and up in one matrix: one GEMM instead of two
        self.gate_up = column_parallel(src, [(f"{prefix}.{name}.weight", part) for name in ("gate_proj", "up_proj")],
                                       dtype=dtype, device=device,
                                       bias=pair("bias") if src.has(f"{prefix}.gate_proj.bias") else None)
        down_bias = None
        if rank == 0 and src.has(f"{prefix}.down_proj.bias"):
            down_bias = src.get(f"{prefix}.down_proj.bias").to(device, dtype)
        self.down = row_parallel(src, [(f"{prefix}.down_proj.weight", part)], dtype=dtype, device=device,
                                 bias=down_bias)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.gate_up.tensors(), *self.down.tensors()]

    def __call__(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return self.down(ops.silu_mul(self.gate_up(x)))


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, src: WeightSource, index: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        p = f"model.layers.{index}"
        self.cfg = cfg
        self.attn_norm = src.get(f"{p}.input_layernorm.weight").to(device, dtype)
        self.mlp_norm = src.get(f"{p}.post_attention_layernorm.weight").to(device, dtype)
        self.attn = Attention(cfg, plan, src, f"{p}.self_attn", dtype, device)
        self.mlp: Mlp | SparseMoe = (
            SparseMoe(cfg, plan, src, f"{p}.mlp", dtype, device) if sparse_layer(cfg, index)
            else Mlp(src, f"{p}.mlp", plan.mlp, dtype, device, plan.rank)
        )

    def tensors(self) -> list[torch.Tensor]:
        return [self.attn_norm, self.mlp_norm, *self.attn.tensors(), *self.mlp.tensors()]


class CausalLM:
    """One rank's shard of a llama-family model. It holds weights only: the KV cache and how a
    step runs (attention kernels, fused ops, CUDA graphs) belong to the rank's runner."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, src: WeightSource, *, dtype: torch.dtype,
                 device: torch.device, max_len: int, stage: Stage | None = None) -> None:
        self.cfg, self.plan, self.dtype, self.device = cfg, plan, dtype, device
        # A pipeline stage holds its layers, the embedding where it starts the model and the head
        # where it ends it; its forward takes and returns the residual stream between stages.
        self.stage = stage
        self.comm = Collectives(plan.world, stage.group if stage else None, stage.root() if stage else 0)
        self.ops = TorchOps()
        ends = stage is None or stage.first or stage.last
        self.vocab = VocabParallel(cfg, plan, src, "model", dtype, device, self.comm) if ends else None
        indices = stage.layers if stage is not None else range(cfg.num_layers)
        self.layers = [DecoderLayer(cfg, plan, src, i, dtype, device) for i in indices]
        self.norm = src.get("model.norm.weight").to(device, dtype)
        divisors = src.get("rope_freqs") if src.has("rope_freqs") else None
        self.rope = rope_tables(cfg, max_len, device, dtype, divisors)
        self.attention_shape = self.layers[0].attn.shape
        self.state_snapshots = False  # it keeps no recurrent state

    @property
    def capturable(self) -> bool:
        """A sparse MoE block's per-expert loop has data-dependent shapes: only its grouped kernel
        (dense experts on a GPU) can be captured in a CUDA graph."""
        return all(layer.mlp.grouped for layer in self.layers if isinstance(layer.mlp, SparseMoe))

    def state_specs(self) -> list[LayerState]:
        return [KvState(self.attention_shape.n_kv, self.attention_shape.head_dim)] * len(self.layers)

    def linears(self) -> tuple[list[AnyLinear], list[str]]:
        found: list[AnyLinear] = self.vocab.linears() if self.vocab is not None else []
        dense_experts = []
        for layer in self.layers:
            found += [layer.attn.qkv, layer.attn.o]
            if isinstance(layer.mlp, Mlp):
                found += [layer.mlp.gate_up, layer.mlp.down]
            else:  # sparse experts: packed pairs, or stacked dense tensors
                found += [lin for pair in layer.mlp.packed for lin in pair]
                if not layer.mlp.packed:
                    dense_experts.append(str(layer.mlp.down.dtype).removeprefix("torch."))
        parts = [part for lin in found for part in (lin.parts if isinstance(lin, ConcatLinear) else [lin])]
        return parts, dense_experts

    def tunable(self) -> list[tuple[object, str]]:
        out: list[tuple[object, str]] = [(self.vocab, "lm_head")] if self.vocab is not None else []
        for layer in self.layers:
            out += [(layer.attn, "qkv"), (layer.attn, "o")]
            if isinstance(layer.mlp, Mlp):
                out += [(layer.mlp, "gate_up"), (layer.mlp, "down")]
        return out

    def weight_bytes(self) -> int:
        vocab = self.vocab.linears() if self.vocab is not None else []
        return unique_bytes([t for lin in vocab for t in lin.tensors()] + [self.norm]
                            + [t for layer in self.layers for t in layer.tensors()])

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: AttentionFn,
                rows: torch.Tensor | None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run the step's flattened tokens (``ids``, ``positions`` [T]); return full-vocabulary
        logits (float32) of the token rows ``rows`` (all rows when None), identical on every rank.
        A pipeline stage after the first starts from the previous stage's residual stream
        ``hidden`` [T, hidden]; a stage before the last returns its own, of every row."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        residual = self.vocab.embed_tokens(ids) if hidden is None else hidden
        h = ops.rms_norm(residual, self.layers[0].attn_norm, eps)
        for i, layer in enumerate(self.layers):
            h, residual = ops.reduce_add_rms_norm(layer.attn(h, i, positions, self.rope, attend), residual,
                                                  layer.mlp_norm, eps, self.comm)
            h = layer.mlp(h, ops)
            if i + 1 == len(self.layers) and self.stage is not None and not self.stage.last:
                return self.comm.all_reduce(h) + residual
            following = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            h, residual = ops.reduce_add_rms_norm(h, residual, following, eps, self.comm)
        return self.vocab.logits(h if rows is None else h[rows])
