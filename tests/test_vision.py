"""Qwen3.5's vision tower (neuron/models/vision.py) against transformers' on a small random
config: one image, and two of different sizes and aspect ratios in one call (each attending to
itself), from the pixel patches of neuron's own image processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from neuron.loader.images import ImageProcessing, pixel_patches
from neuron.models.vision import VisionTower

CONFIG = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48, patch_size=8,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=144, in_channels=3,
              hidden_act="gelu_pytorch_tanh", rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
PROCESSING = ImageProcessing.from_config({"patch_size": 8, "temporal_patch_size": 2, "merge_size": 2,
                                          "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                                          "size": {"shortest_edge": 16 * 16 * 4, "longest_edge": 16 * 16 * 40}})


@pytest.fixture(scope="module")
def towers():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    torch.manual_seed(0)
    theirs = Qwen3_5VisionModel(Qwen3_5VisionConfig(**CONFIG)).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    tensors = {f"model.visual.{k}": v for k, v in theirs.state_dict().items()}

    class Source:
        def get(self, name, **_):
            return tensors[name]

    return theirs, VisionTower(CONFIG, Source(), "model.visual.", torch.float32, torch.device("cpu"))


def patches(width: int, height: int, seed: int):
    rng = np.random.default_rng(seed)
    return pixel_patches(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)), PROCESSING)


@pytest.mark.parametrize("sizes", [[(64, 48)], [(120, 40), (33, 90)]], ids=["one", "two"])
def test_the_tower_gives_transformers_embeddings(towers, sizes):
    theirs, ours = towers
    images = [patches(w, h, i) for i, (w, h) in enumerate(sizes)]
    pixels = torch.from_numpy(np.concatenate([p for p, _ in images]))
    grids = [g for _, g in images]
    with torch.no_grad():
        want = theirs(pixels, grid_thw=torch.tensor(grids)).pooler_output
    got = ours(pixels, grids)
    assert got.shape == want.shape == (sum(t * h * w for t, h, w in grids) // 4, CONFIG["out_hidden_size"])
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    tokens = [PROCESSING.tokens(h, w) for w, h in sizes]
    assert sum(tokens) == got.shape[0]  # what the leader counts is what the tower gives
