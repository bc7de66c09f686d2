"""Packed products with x in int8 (NEURON_CPU_ACTIVATIONS=int8, csrc/qdot.h), as llama.cpp's CPU
backend and our GPU decode multiply, and in int16 (the x86 default, csrc/qblock.h). The kernels
equal the float product of x's integer form (test_cpu_isa.py); here, the whole default model on
real text: int8 moves the logits (it is in use) but not, on the whole, what the model predicts;
int16 moves them a hundredth as much and changes no prediction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import cpu_activations
from devtools.parity import ParityJob, run_parity
from neuron.kernels import isa
from neuron.loader.resolve import default_model_path
from neuron.loader.spec import load_spec

TEXT = (
    "The river rose through the night, and by morning the lower streets of the town were under water. "
    "People carried what they could to the church on the hill, where the priest had opened the doors "
    "and lit the stoves. Children slept on the pews while their parents watched the water from the steps. "
    "By noon the rain had stopped, but the river kept rising for two more days before it began to fall. "
    "When it did, it left a line of mud on every wall, a little above the height of a man, and the town "
    "spent the rest of the summer scraping it off. The old men said it was the worst flood since 1911. "
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"
)


def against_float32(kind: str) -> tuple[dict[str, float], float, float, int]:
    """The default model teacher-forced over TEXT with x in float32 and in ``kind``: each one's
    NLL, their top-1 agreement, the largest logit difference, and the token count."""
    path = default_model_path()
    spec = load_spec(str(path))
    ids = spec.tokenizer.tokenizer.encode(TEXT, add_special_tokens=False).ids
    job = ParityJob("smollm2", "gguf", [str(path)], spec.config, [ids[:8]], 0, score=[ids], keep_scored=True,
                    max_len=512)
    out = {}
    for form in ("float32", kind):
        with cpu_activations(form):
            out[form] = run_parity([job], 1)[0]
    target = torch.tensor(ids[1:])
    nll = {k: float(F.cross_entropy(r.scored[0][:-1], target)) for k, r in out.items()}
    agree = sum(a == b for a, b in zip(out["float32"].argmax[0], out[kind].argmax[0])) / len(ids)
    moved = float((out["float32"].scored[0] - out[kind].scored[0]).abs().max())
    print(f"{len(ids)} tokens: nll {nll}, top-1 agreement {agree:.4f}, max |logit diff| {moved:.4f}")
    return nll, agree, moved, len(ids)


@pytest.mark.skipif(not isa.choose().int8, reason="this CPU's kernels multiply in float32 only")
def test_int8_activations_move_the_logits_but_not_the_default_models_predictions(one_torch_thread):
    nll, agree, moved, _ = against_float32("int8")
    assert moved > 1e-3  # the int8 products really ran
    assert abs(nll["int8"] - nll["float32"]) <= 0.02 * nll["float32"]  # seen: +0.2% (avx2), +0.6% (avx512)
    assert agree >= 0.93  # seen: 0.98, 0.97


@pytest.mark.skipif(not isa.choose().int8, reason="this CPU's kernels multiply in float32 only")
def test_int16_activations_predict_what_float32_x_predicts_on_the_default_model(one_torch_thread):
    """The x86 default (csrc/qblock.h): x rounded to 16 bits per group of 32 leaves the default
    model's predictions on real text as float32 x gives them, where int8 x moves some."""
    nll, agree, moved, tokens = against_float32("int16")
    assert 0 < moved <= 0.05  # seen: 0.0065 (int8 x: 1.14)
    assert abs(nll["int16"] - nll["float32"]) <= 0.001 * nll["float32"]  # seen: +0.0002%
    assert agree >= 0.995 and tokens > 100  # seen: 1.0, every one of the 163
