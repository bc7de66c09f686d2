"""devtools.shaped_gguf: a random-weight GGUF of a model's shape (the CPU bench's file of the size
users run) is a file neuron serves: each type's blocks decode to finite, small weights of the
shape's sizes, and a server answers from it with every token it was asked for."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from conftest import start_server
from devtools.shaped_gguf import SHAPES, TYPES, layer_tensors, write_shaped_gguf


@pytest.mark.parametrize("type_name", TYPES)
def test_each_type_s_random_blocks_are_small_finite_weights_of_the_shape(tmp_path, type_name):
    import gguf

    path = write_shaped_gguf("qwen3-tiny", type_name, tmp_path)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert list(tensors) == [name for name, _ in layer_tensors(SHAPES["qwen3-tiny"])]
    q = tensors["blk.0.attn_q.weight"]
    weights = gguf.quants.dequantize(q.data, q.tensor_type)
    assert weights.shape == (256, 256) and np.isfinite(weights).all()
    assert 0.002 < float(np.abs(weights).mean()) < 0.1, float(np.abs(weights).mean())


def test_a_server_answers_from_a_shaped_file_with_every_token_asked_for(tmp_path):
    path = write_shaped_gguf("qwen3-tiny", "Q4_0", tmp_path)
    server = start_server(tmp_path, config=f'[[models]]\nmodel = "{path}"\nid = "shaped"\nmax_model_len = 512\n')
    try:
        r = httpx.post(f"{server.base}/completions", timeout=120, json={
            "model": "shaped", "prompt": "a short prompt", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        assert server.stop() == 0
