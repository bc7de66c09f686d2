"""The hybrid decoder of Qwen3-Next and Qwen3.5: Gated DeltaNet layers (``deltanet``) and full
attention layers in the pattern of ``layer_types``, each followed by an MLP, or by sparse experts
beside a shared expert behind a sigmoid gate (Qwen3-Next). Its RMS norms are zero-centred (the
checkpoint holds ``w - 1``; one is added at load).

Full attention carries an output gate (``q_proj`` holds each head's query and gate rows side by
side: ``o = o_proj(attn * sigmoid(gate))``), q/k norm, and RoPE on only the first
``partial_rotary_factor`` of each head's dimensions. The attention kernels rotate whole heads in
the "rotate half" layout, which pairs dimension ``i`` with ``i + head_dim / 2``; the partial
rotation pairs ``i`` with ``i + rot / 2``. So q and k (and their norm weights) are stored with their
dimensions reordered, the rotated pairs at ``i`` and ``i + head_dim / 2`` and the rest in the
frequency slots whose cos is 1 and sin 0: q·k is unchanged by the same reordering of both, and
the kernels run as they are.
"""

from __future__ import annotations

import torch

from protocol import ModelConfig

from .deltanet import DeltaNetShape, GatedDeltaNet, key_heads
from .interface import AttentionFn, AttentionShape, KvState, LayerState
from .layers import Collectives, WeightSource, unique_bytes
from .llama import Mlp
from .moe import SparseMoe
from .mrope import mrope_angles
from .mtp import PREFIX as MTP_PREFIX, MtpHead
from .ops import RopeTables, Rotary, TorchOps
from .sharding import ShardPlan, sparse_layer, split_blocks
from .tp_linear import AnyLinear, ConcatLinear, column_parallel, row_parallel
from .vision import TOWER_PREFIX, VisionTower
from .vocab import VocabParallel


def rotary_order(head_dim: int, rot: int) -> list[int]:
    """For each stored dimension of a head, the checkpoint's dimension it holds (see above)."""
    half, rhalf = head_dim // 2, rot // 2
    rest = list(range(rot, head_dim))
    return list(range(rhalf)) + rest[: half - rhalf] + list(range(rhalf, rot)) + rest[half - rhalf:]


def _runs(order: list[int], base: int) -> list[range]:
    """``order`` (offset by ``base``) as contiguous ranges."""
    runs: list[range] = []
    for i in order:
        if runs and runs[-1].stop == base + i:
            runs[-1] = range(runs[-1].start, base + i + 1)
        else:
            runs.append(range(base + i, base + i + 1))
    return runs


def rotary_freqs(cfg: ModelConfig) -> torch.Tensor:
    """The inverse frequencies of a head's rotated dimensions (in the stored order's frequency
    slots, see above), zero for the slots that do not rotate: [head_dim / 2]."""
    hd = cfg.head_dim
    rot = int(hd * float(cfg.extra.get("partial_rotary_factor", 1.0)))
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    return torch.cat([inv, torch.zeros(hd // 2 - rot // 2)])


def partial_rope(cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> RopeTables:
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rotary_freqs(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    return RopeTables(emb.cos().to(device, dtype), emb.sin().to(device, dtype))


def zero_centred(src: WeightSource, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return (src.get(name).float() + 1.0).to(device, dtype)


class GatedAttention:
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, src: WeightSource, prefix: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        hd = cfg.head_dim
        self.n_q, self.n_kv = len(plan.q_heads), len(plan.kv_heads)
        order = rotary_order(hd, int(hd * float(cfg.extra.get("partial_rotary_factor", 1.0))))
        q, k, v, o = (f"{prefix}.{x}_proj.weight" for x in "qkvo")
        rows = [(q, r) for h in plan.q_heads for r in _runs(order, 2 * hd * h)]
        rows += [(k, r) for h in plan.kv_heads for r in _runs(order, hd * h)]
        rows += [(v, range(plan.kv_heads.start * hd, plan.kv_heads.stop * hd))]
        self.qkv = column_parallel(src, rows, dtype=dtype, device=device)
        self.gate = column_parallel(src, [(q, range(2 * hd * h + hd, 2 * hd * (h + 1))) for h in plan.q_heads],
                                    dtype=dtype, device=device)
        self.o = row_parallel(src, [(o, range(plan.q_heads.start * hd, plan.q_heads.stop * hd))], dtype=dtype,
                              device=device)
        self.q_norm = zero_centred(src, f"{prefix}.q_norm.weight", device, dtype)[order]
        self.k_norm = zero_centred(src, f"{prefix}.k_norm.weight", device, dtype)[order]
        self.eps, self.hd = cfg.rms_norm_eps, hd
        groups = self.n_q // self.n_kv if self.n_q % self.n_kv == 0 else 0
        uniform = groups and plan.kv_of_q == tuple(i // groups for i in range(self.n_q))
        self.shape = AttentionShape(self.n_q, self.n_kv, hd, hd ** -0.5, plan.kv_of_q, groups if uniform else 0)

    def linears(self) -> list[AnyLinear]:
        return [self.qkv, self.gate, self.o]

    def tensors(self) -> list[torch.Tensor]:
        return [t for lin in self.linears() for t in lin.tensors()] + [self.q_norm, self.k_norm]

    def __call__(self, x: torch.Tensor, layer: int, positions: torch.Tensor, rope: RopeTables,
                 attend: AttentionFn) -> torch.Tensor:
        qkv = self.qkv(x).view(x.shape[0], self.n_q + 2 * self.n_kv, self.hd)
        out = attend(layer, qkv, positions, Rotary(rope, self.q_norm, self.k_norm, self.eps))
        return self.o(out * torch.sigmoid(self.gate(x)))


class SharedExpertMoe:
    """Sparse experts plus a shared expert whose output is scaled by ``sigmoid(x . w_gate)``; the
    shared expert's columns are split like a dense MLP's (in whole ``block``s), its gate row rides
    on the router."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, src: WeightSource, prefix: str, dtype: torch.dtype,
                 device: torch.device, block: int = 1) -> None:
        shared = int(cfg.extra.get("shared_expert_intermediate_size", 0))
        gate = src.get(f"{prefix}.shared_expert_gate.weight") if shared else None
        self.sparse = SparseMoe(cfg, plan, src, prefix, dtype, device, shared_gate=gate)
        part = split_blocks(shared, plan.world, plan.rank, block)
        self.shared = Mlp(src, f"{prefix}.shared_expert", part, dtype, device, plan.rank) if shared else None

    def tensors(self) -> list[torch.Tensor]:
        return [*self.sparse.tensors(), *(self.shared.tensors() if self.shared is not None else [])]

    def __call__(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return self.sparse(x, ops, self.shared)


class HybridLayer:
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, src: WeightSource, prefix: str, kind: str, index: int,
                 dtype: torch.dtype, device: torch.device, block: int) -> None:
        self.kind = kind
        self.attn_norm = zero_centred(src, f"{prefix}.input_layernorm.weight", device, dtype)
        self.mlp_norm = zero_centred(src, f"{prefix}.post_attention_layernorm.weight", device, dtype)
        self.mixer: GatedAttention | GatedDeltaNet = (
            GatedAttention(cfg, plan, src, f"{prefix}.self_attn", dtype, device) if kind == "full_attention"
            else GatedDeltaNet(cfg, src, f"{prefix}.linear_attn", dtype, device, key_heads(cfg, plan.world, plan.rank)))
        self.mlp: Mlp | SharedExpertMoe = (SharedExpertMoe(cfg, plan, src, f"{prefix}.mlp", dtype, device, block)
                                           if sparse_layer(cfg, index)
                                           else Mlp(src, f"{prefix}.mlp", plan.mlp, dtype, device, plan.rank))


class HybridLM:
    """One rank's shard of a hybrid model: full attention split as the llama family's, linear
    attention by whole key heads (with their value heads), experts and MLPs as ``sharding`` says,
    one all-reduce after each mixer and each MLP."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, src: WeightSource, *, dtype: torch.dtype,
                 device: torch.device, max_len: int, block: int = 1, mtp: bool = False) -> None:
        self.cfg, self.plan, self.dtype, self.device = cfg, plan, dtype, device
        prefix = str(cfg.extra.get("prefix", "model"))
        self.comm = Collectives(plan.world)
        self.ops = TorchOps()
        self.vocab = VocabParallel(cfg, plan, src, prefix, dtype, device, self.comm)
        self.layers = [HybridLayer(cfg, plan, src, f"{prefix}.layers.{i}", kind, i, dtype, device, block)
                       for i, kind in enumerate(cfg.layer_types)]
        self.state_snapshots = True
        self.norm = zero_centred(src, f"{prefix}.norm.weight", device, dtype)
        self.rope = partial_rope(cfg, max_len, device, dtype)
        self.vision = VisionTower(cfg.vision["config"], src, TOWER_PREFIX, dtype, device) if cfg.vision else None
        self.inv_freq = rotary_freqs(cfg).to(device)
        self.attention_shape = next(layer.mixer.shape for layer in self.layers if layer.kind == "full_attention")
        self.recurrent = DeltaNetShape(cfg, key_heads(cfg, plan.world, plan.rank), dtype).state()
        # The MTP layer (speculative decoding) and, while it is loaded, each forward's final normed
        # hidden states, every row (its input).
        self.mtp: MtpHead | None = None
        self.hidden: torch.Tensor | None = None
        if mtp:
            layer = HybridLayer(cfg, plan, src, f"{MTP_PREFIX}.layers.0", "full_attention", 0, dtype, device, block)
            self.mtp = MtpHead(src, dtype, device, layer, lambda name: zero_centred(src, name, device, dtype),
                               cfg.layer_types.count("full_attention"))

    @property
    def capturable(self) -> bool:
        """Sparse experts only in their grouped kernel (see SparseMoe.grouped)."""
        return all(layer.mlp.sparse.grouped for layer in self.layers if isinstance(layer.mlp, SharedExpertMoe))

    def state_specs(self) -> list[LayerState]:
        kv = KvState(self.attention_shape.n_kv, self.attention_shape.head_dim)
        return [kv if layer.kind == "full_attention" else self.recurrent for layer in self.layers] + \
            ([kv] if self.mtp is not None else [])

    def linears(self) -> tuple[list[AnyLinear], list[str]]:
        found: list[AnyLinear] = self.vocab.linears() + (self.mtp.linears() if self.mtp is not None else [])
        dense_experts = []
        for layer in self.layers:
            found += layer.mixer.linears()
            if isinstance(layer.mlp, Mlp):
                found += [layer.mlp.gate_up, layer.mlp.down]
            else:
                sparse = layer.mlp.sparse
                found += [lin for pair in sparse.packed for lin in pair]
                if layer.mlp.shared is not None:
                    found += [layer.mlp.shared.gate_up, layer.mlp.shared.down]
                if not sparse.packed:
                    dense_experts.append(str(sparse.down.dtype).removeprefix("torch."))
        parts = [part for lin in found for part in (lin.parts if isinstance(lin, ConcatLinear) else [lin])]
        return parts, dense_experts

    def tunable(self) -> list[tuple[object, str]]:
        return []

    def weight_bytes(self) -> int:
        tensors = [t for lin in self.vocab.linears() for t in lin.tensors()] + [self.norm]
        tensors += self.vision.tensors() if self.vision is not None else []
        tensors += self.mtp.tensors() if self.mtp is not None else []
        for layer in self.layers:
            tensors += [layer.attn_norm, layer.mlp_norm, *layer.mixer.tensors(), *layer.mlp.tensors()]
        return unique_bytes(tensors)

    def mrope_tables(self, positions: torch.Tensor) -> RopeTables:
        """Rotary tables of rows at M-RoPE ``positions`` [3, n] (Qwen3.5's images)."""
        angles = mrope_angles(positions, self.inv_freq, [int(x) for x in self.cfg.vision["mrope_section"]])
        emb = torch.cat((angles, angles), dim=-1)
        return RopeTables(emb.cos().to(self.dtype), emb.sin().to(self.dtype))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: AttentionFn,
                rows: torch.Tensor | None) -> torch.Tensor:
        ops, eps = self.ops, self.cfg.rms_norm_eps
        h = self.vocab.embed_tokens(ids)
        rope, rope_at = self.rope, positions
        images = getattr(attend.meta, "images", None)
        if images is not None:  # image embeddings at their pad tokens, and the step's M-RoPE rows
            if images.rows is not None:
                h[images.rows] = images.embeds.to(h.dtype)
            rope, rope_at = images.rope, images.rope_index
        kv_layer = state_layer = 0
        x = ops.rms_norm(h, self.layers[0].attn_norm, eps)
        for i, layer in enumerate(self.layers):
            if layer.kind == "full_attention":
                y = layer.mixer(x, kv_layer, rope_at, rope, attend)
                kv_layer += 1
            else:
                y = layer.mixer(x, attend.states.layer(state_layer), attend.meta.state_spans, ops)
                state_layer += 1
            x, h = ops.reduce_add_rms_norm(y, h, layer.mlp_norm, eps, self.comm)
            following = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            x, h = ops.reduce_add_rms_norm(layer.mlp(x, ops), h, following, eps, self.comm)
        if self.mtp is not None:
            self.hidden = x
        return self.vocab.logits(x if rows is None else x[rows])

    def mtp_forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attend: AttentionFn,
                    rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer's normed outputs and the logits of ``rows`` (``mtp.MtpHead.forward``)."""
        assert self.mtp is not None
        return self.mtp.forward(self, ids, positions, hidden, attend, rows)
