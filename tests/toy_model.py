"""The toy recurrent family's model (see toy_family.py), with the interface of
``neuron.models.interface.Model``, and a plain full-sequence forward to check it against."""

from __future__ import annotations

import torch

from neuron.models.interface import KvState, LayerState, RecurrentState
from neuron.models.layers import Collectives, rope_tables
from neuron.models.tp_linear import column_parallel
from neuron.models.llama import Attention, Mlp
from neuron.models.ops import TorchOps, apply_rope, rms_norm
from neuron.models.sharding import plan_shard


class Recurrence:
    def __init__(self, src, prefix: str, dtype: torch.dtype, device: torch.device) -> None:
        self.w_in = column_parallel(src, [(f"{prefix}.in_proj.weight", None)], dtype=dtype, device=device)
        self.w_out = column_parallel(src, [(f"{prefix}.out_proj.weight", None)], dtype=dtype, device=device)
        self.decay = torch.sigmoid(src.get(f"{prefix}.decay").float()).to(device)

    def __call__(self, x: torch.Tensor, state: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """``state`` [slots + 1, H] float32: each sequence's row is read, advanced over its tokens
        of the step, and written back."""
        u = self.w_in(x).float()
        out = torch.empty_like(u)
        for row, n, slot in spans:
            s = state[slot]
            for t in range(row, row + n):
                s = self.decay * s + u[t]
                out[t] = s
            state[slot] = s
        return self.w_out(out.to(x.dtype))


class ToyLayer:
    def __init__(self, cfg, plan, src, index: int, kind: str, dtype, device) -> None:
        p = f"model.layers.{index}"
        self.kind = kind
        self.norm1 = src.get(f"{p}.input_layernorm.weight").to(device, dtype)
        self.norm2 = src.get(f"{p}.post_attention_layernorm.weight").to(device, dtype)
        self.mixer = (Attention(cfg, plan, src, f"{p}.self_attn", dtype, device) if kind == "attention"
                      else Recurrence(src, f"{p}.mixer", dtype, device))
        self.mlp = Mlp(src, f"{p}.mlp", plan.mlp, dtype, device)


class ToyRecurrentLM:
    def __init__(self, cfg, src, *, dtype: torch.dtype, device: torch.device, max_len: int) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        plan = plan_shard(cfg, 1, 0)
        self.comm = Collectives(1)
        self.ops = TorchOps()
        self.capturable = False
        self.state_snapshots = False  # its recurrence takes none: no prefix cache
        self.embed = column_parallel(src, [("model.embed_tokens.weight", None)], dtype=dtype, device=device)
        self.lm_head = self.embed
        self.norm = src.get("model.norm.weight").to(device, dtype)
        self.layers = [ToyLayer(cfg, plan, src, i, kind, dtype, device) for i, kind in enumerate(cfg.layer_types)]
        self.rope = rope_tables(cfg, max_len, device, dtype)
        self.attention_shape = next(layer.mixer.shape for layer in self.layers if layer.kind == "attention")

    def state_specs(self) -> list[LayerState]:
        shape = self.attention_shape
        return [KvState(shape.n_kv, shape.head_dim) if layer.kind == "attention"
                else RecurrentState(((self.cfg.hidden_size,),)) for layer in self.layers]

    def weight_bytes(self) -> int:
        parts, _ = self.linears()
        return sum(t.numel() * t.element_size() for lin in parts for t in lin.tensors())

    def linears(self):
        found = [self.embed]
        for layer in self.layers:
            m = layer.mixer
            found += [m.qkv, m.o] if layer.kind == "attention" else [m.w_in, m.w_out]
            found += [layer.mlp.gate_up, layer.mlp.down]
        return found, []

    def tunable(self):
        return []

    @torch.inference_mode()
    def forward(self, ids, positions, attend, rows):
        ops, eps = self.ops, self.cfg.rms_norm_eps
        h = self.embed.rows(ids)
        kv_layer = state_layer = 0
        for layer in self.layers:
            x = ops.rms_norm(h, layer.norm1, eps)
            if layer.kind == "attention":
                y = layer.mixer(x, kv_layer, positions, self.rope, attend)
                kv_layer += 1
            else:
                y = layer.mixer(x, attend.states.layer(state_layer)[0], attend.meta.state_spans.spans)
                state_layer += 1
            h = h + y
            h = h + layer.mlp(ops.rms_norm(h, layer.norm2, eps), ops)
        h = ops.rms_norm(h, self.norm, eps)
        return self.lm_head(h if rows is None else h[rows], out_dtype=torch.float32)[:, : self.cfg.vocab_size]


def reference_logits(w: dict[str, torch.Tensor], cfg, ids: list[int]) -> torch.Tensor:
    """The last position's logits of ``ids`` by a plain full-sequence forward (float32)."""
    eps, H = cfg.rms_norm_eps, cfg.hidden_size
    nh, hd = cfg.num_heads, cfg.head_dim
    T = len(ids)
    rope = rope_tables(cfg, T, torch.device("cpu"), torch.float32)
    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        if kind == "attention":
            q, k, v = (x @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
            q, k, v = (t.view(T, nh, hd) for t in (q, k, v))
            q, k = apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin)
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = a.transpose(0, 1).reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        else:
            a = torch.sigmoid(w[p + "mixer.decay"])
            u = x @ w[p + "mixer.in_proj.weight"].T
            s, out = torch.zeros(H), []
            for t in range(T):
                s = a * s + u[t]
                out.append(s)
            y = torch.stack(out) @ w[p + "mixer.out_proj.weight"].T
        h = h + y
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(h, w["model.norm.weight"], eps)[-1] @ w["model.embed_tokens.weight"].T
