"""Qwen3.5's vision tower: an image's pixel patches (neuron/loader/images.py) to the embeddings
its image-pad tokens take in the text model. Patches embedded (the 3-D conv as one product),
a learned position table resampled bilinearly to the image's grid, transformer blocks with 2-D
rotary positions attending within each image, and the merger, which folds each 2 x 2 window of
patches into one token. Replicated on every rank: the tower is small beside the text model (0.4B
of Qwen3.5-27B's 27B), so splitting it would buy little and cost an all-reduce per block."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

TOWER_PREFIX = "model.visual."  # the tower's tensors in a ForConditionalGeneration checkpoint


class VisionTower:
    def __init__(self, cfg: dict[str, Any], src, prefix: str, dtype: torch.dtype, device: torch.device) -> None:
        self.dim, self.heads = int(cfg["hidden_size"]), int(cfg["num_heads"])
        self.merge = int(cfg.get("spatial_merge_size", 2))
        self.side = int(int(cfg["num_position_embeddings"]) ** 0.5)
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        if cfg.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision hidden_act {cfg.get('hidden_act')!r} is not supported")
        self.tanh = cfg.get("hidden_act", "gelu_pytorch_tanh") == "gelu_pytorch_tanh"
        self.dtype, self.device = dtype, device

        def get(name: str) -> torch.Tensor:
            return src.get(prefix + name).to(device, dtype)

        conv = get("patch_embed.proj.weight")
        self.patch_w, self.patch_b = conv.reshape(conv.shape[0], -1), get("patch_embed.proj.bias")
        self.pos = get("pos_embed.weight")
        self.blocks = []
        for i in range(int(cfg["depth"])):
            p = f"blocks.{i}."
            self.blocks.append({k: get(p + k) for k in (
                "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attn.qkv.weight", "attn.qkv.bias",
                "attn.proj.weight", "attn.proj.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")})
        self.merger = {k: get("merger." + k) for k in ("norm.weight", "norm.bias", "linear_fc1.weight",
                                                       "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")}
        head = self.dim // self.heads
        self.inv_freq = 1.0 / theta ** (torch.arange(0, head // 2, 2, dtype=torch.float32, device=device) / (head // 2))

    def tensors(self) -> list[torch.Tensor]:
        return [self.patch_w, self.patch_b, self.pos, *(t for b in self.blocks for t in b.values()),
                *self.merger.values()]

    def _positions(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """(row, column) of each patch, in merge-window order (the patches' order): [t h w, 2]."""
        t, h, w = grid
        m = self.merge
        rows = torch.arange(h, device=self.device)[:, None].expand(h, w)
        cols = torch.arange(w, device=self.device)[None, :].expand(h, w)
        order = lambda x: x.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1)  # noqa: E731
        return torch.stack([order(rows), order(cols)], dim=-1).repeat(t, 1)

    def _position_table(self, at: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """The learned square table resampled (bilinear, corners aligned) to the grid's patches."""
        _, h, w = grid
        side = self.side
        taps, weights = [], []
        for coord, size in ((at[:, 0], h), (at[:, 1], w)):
            src = coord.float() * (side - 1) / max(size - 1, 1)
            floor = torch.floor(src)
            offsets = torch.arange(2, device=self.device)
            taps.append((floor.long()[:, None] + offsets).clamp(0, side - 1))
            weights.append((1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0))
        index = (taps[0][:, :, None] * side + taps[1][:, None, :]).reshape(-1, 4)
        weight = (weights[0][:, :, None] * weights[1][:, None, :]).reshape(-1, 4)
        return (self.pos[index] * weight[:, :, None].to(self.pos.dtype)).sum(1)

    def _rotary(self, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = at[..., None].float() * self.inv_freq  # [N, 2, head / 4]
        half = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([half, half], dim=-1)
        return angles.cos(), angles.sin()

    def __call__(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Embeddings [patches / merge², out_hidden] of the images whose patches ``pixels`` holds
        one after another ([sum of t h w, 3 T P P]), each image's ``grids`` entry."""
        x = F.linear(pixels.to(self.device, self.dtype), self.patch_w, self.patch_b)
        at = torch.cat([self._positions(g) for g in grids])
        x = x + torch.cat([self._position_table(self._positions(g), g) for g in grids]).to(x.dtype)
        cos, sin = self._rotary(at)
        lengths = [g[1] * g[2] for g in grids for _ in range(g[0])]
        for block in self.blocks:
            x = x + self._attention(F.layer_norm(x, (self.dim,), block["norm1.weight"], block["norm1.bias"], 1e-6),
                                    block, cos, sin, lengths)
            y = F.layer_norm(x, (self.dim,), block["norm2.weight"], block["norm2.bias"], 1e-6)
            y = F.gelu(F.linear(y, block["mlp.linear_fc1.weight"], block["mlp.linear_fc1.bias"]),
                       approximate="tanh" if self.tanh else "none")
            x = x + F.linear(y, block["mlp.linear_fc2.weight"], block["mlp.linear_fc2.bias"])
        m = self.merger
        x = F.layer_norm(x, (self.dim,), m["norm.weight"], m["norm.bias"], 1e-6).reshape(-1, self.dim * self.merge ** 2)
        x = F.gelu(F.linear(x, m["linear_fc1.weight"], m["linear_fc1.bias"]))
        return F.linear(x, m["linear_fc2.weight"], m["linear_fc2.bias"])

    def _attention(self, x: torch.Tensor, block: dict, cos: torch.Tensor, sin: torch.Tensor,
                   lengths: list[int]) -> torch.Tensor:
        n, head = x.shape[0], self.dim // self.heads
        q, k, v = F.linear(x, block["attn.qkv.weight"], block["attn.qkv.bias"]).reshape(n, 3, self.heads, head).unbind(1)
        q, k = (_rotate(t, cos, sin) for t in (q, k))
        out = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):  # each image attends to itself
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            out.append(o.transpose(0, 1).reshape(-1, self.dim))
        return F.linear(torch.cat(out), block["attn.proj.weight"], block["attn.proj.bias"])


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = t.dtype
    t = t.float()
    half = t.shape[-1] // 2
    rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return (t * cos[:, None] + rotated * sin[:, None]).to(dtype)
