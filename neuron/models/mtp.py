"""The multi-token-prediction layer Qwen3.5 and Qwen3-Next checkpoints ship beside the model
(``mtp.*``, ``mtp_num_hidden_layers = 1``), a drafter for speculative decoding.

At position ``i`` it takes the model's final (normed) hidden state ``h_i`` and the token after
it, ``t_{i+1}``, and guesses ``t_{i+2}``: ``fc`` (2H -> H) over ``[norm_e(embed(t_{i+1})),
norm_h(h_i)]``, one full-attention layer of the model's own kind (``mtp.layers.0``, its K/V in a
KV layer of its own after the model's), then ``mtp.norm``; the embedding and the LM head are the
model's. A further guess chains on the layer's own normed output in place of ``h``. Its RMS
norms are zero-centred, like the rest of the family's. It is split across ranks like the model's
full-attention layers; ``fc`` is whole on every rank."""

from __future__ import annotations

from typing import Callable

import torch

from .interface import AttentionFn
from .layers import WeightSource, unique_bytes
from .tp_linear import AnyLinear, column_parallel

PREFIX = "mtp"


class MtpHead:
    def __init__(self, src: WeightSource, dtype: torch.dtype, device: torch.device, layer,
                 norm: Callable[[str], torch.Tensor], kv_layer: int) -> None:
        """``layer``: the model's full-attention layer built from ``mtp.layers.0``; ``norm``: a
        zero-centred norm's weight by name."""
        self.fc = column_parallel(src, [(f"{PREFIX}.fc.weight", None)], dtype=dtype, device=device)
        self.norm_embed = norm(f"{PREFIX}.pre_fc_norm_embedding.weight")
        self.norm_hidden = norm(f"{PREFIX}.pre_fc_norm_hidden.weight")
        self.layer = layer
        self.norm = norm(f"{PREFIX}.norm.weight")
        self.kv_layer = kv_layer

    def linears(self) -> list[AnyLinear]:
        return [self.fc, *self.layer.mixer.linears()]

    def tensors(self) -> list[torch.Tensor]:
        layer = self.layer
        return [*self.fc.tensors(), self.norm_embed, self.norm_hidden, self.norm, layer.attn_norm, layer.mlp_norm,
                *layer.mixer.tensors(), *layer.mlp.tensors()]

    def nbytes(self) -> int:
        return unique_bytes(self.tensors())

    @torch.inference_mode()
    def forward(self, model, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attend: AttentionFn,
                rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over rows of (``ids``: t_{i+1}, ``positions``: i, ``hidden``: h_i): its
        normed outputs (every row) and the logits of ``rows``."""
        ops, eps, comm = model.ops, model.cfg.rms_norm_eps, model.comm
        e = ops.rms_norm(model.vocab.embed_tokens(ids), self.norm_embed, eps)
        h = self.fc(torch.cat([e, ops.rms_norm(hidden.to(e.dtype), self.norm_hidden, eps)], dim=-1))
        layer = self.layer
        x = ops.rms_norm(h, layer.attn_norm, eps)
        y = layer.mixer(x, self.kv_layer, positions, model.rope, attend)
        x, h = ops.reduce_add_rms_norm(y, h, layer.mlp_norm, eps, comm)
        x, h = ops.reduce_add_rms_norm(layer.mlp(x, ops), h, self.norm, eps, comm)
        return x, model.vocab.logits(x[rows])
