"""M-RoPE (neuron/models/mrope.py) against transformers' Qwen3.5: the 3-D positions of prompts
with no, one and two images (get_rope_index), and the rotary angles they give."""

from __future__ import annotations

import pytest
import torch

from neuron.models.mrope import mrope_cos_sin, mrope_positions

IMAGE, START, END = 90, 88, 89


def prompt(layout):
    """Token ids and grids for a layout like ["text", 5, (1, 8, 12), "text", 3]."""
    tokens, grids = [], []
    for item in layout:
        if isinstance(item, int):
            tokens += [(7 * len(tokens)) % 80 + 1 for _ in range(item)]
        else:
            tokens += [START] + [IMAGE] * (item[0] * item[1] * item[2] // 4) + [END]
            grids.append(item)
    return tokens, grids


@pytest.mark.parametrize("layout", [[12], [3, (1, 4, 6), 5], [2, (1, 8, 4), 1, (1, 6, 6), 4], [(1, 2, 16)]])
def test_positions_and_angles_equal_transformers(layout):
    from transformers import Qwen3_5Config, Qwen3_5Model
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    tokens, grids = prompt(layout)
    text = dict(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=32, linear_num_key_heads=1, linear_num_value_heads=1, layer_types=["full_attention"])
    config = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                                 out_hidden_size=64, spatial_merge_size=2),
                           image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
    model = Qwen3_5Model(config)
    ids = torch.tensor([tokens])
    want, delta = model.get_rope_index(ids, (ids == IMAGE).int(), torch.tensor(grids) if grids else None)
    got, got_delta = mrope_positions(tokens, IMAGE, grids, 2)
    assert got.tolist() == want[:, 0].tolist() and got_delta == int(delta)
    rotary = Qwen3_5TextRotaryEmbedding(config.text_config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), want)
    sections = config.text_config.rope_parameters.get("mrope_section", [11, 11, 10])
    ours = mrope_cos_sin(torch.from_numpy(got), rotary.inv_freq, sections)
    assert torch.allclose(ours[0], cos[0], atol=1e-6) and torch.allclose(ours[1], sin[0], atol=1e-6)


def test_a_prompt_whose_image_tokens_do_not_match_its_grids_is_an_error():
    tokens, grids = prompt([2, (1, 4, 4), 1])
    with pytest.raises(ValueError, match="an image of 8 tokens"):
        mrope_positions(tokens, IMAGE, [(1, 4, 8)], 2)
    with pytest.raises(ValueError, match="more image grids"):
        mrope_positions(tokens, IMAGE, grids + [(1, 4, 4)], 2)
