"""The Triton kernels for packed weights (GPU path), run by Triton's interpreter on the CPU
against the float32 torch reference: 4- and 8-bit integers, a scale per 32 or per 16, batches
1..64, the real layouts of a GGUF tensor. The interpreter cannot multiply bfloat16 tiles
(``tl.dot`` on bf16 returns garbage there, on any kernel), so it checks float16 and float32
activations; bfloat16 runs the same code on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent

CHECK = r"""
import json, numpy as np, torch, gguf
from neuron.models.quant import decode_blocks, pack_nibbles
from neuron.models.triton_kernels import qlinear, reference_qlinear
from neuron.tools.checkpoints import random_quant_blocks
rng = np.random.default_rng(7)
out = []
for name in ("Q4_1", "Q8_0", "Q4_K", "Q6_K"):
    qt = gguf.GGMLQuantizationType[name]
    raw = random_quant_blocks(name, (96, 256), rng) if name.endswith("_K") else gguf.quants.quantize(
        (rng.standard_normal((96, 256)) * 0.1).astype(np.float32), qt)
    q = decode_blocks(raw, qt)
    bits = 4 if q.bits <= 4 else 8
    u = torch.from_numpy(q.u)
    u = pack_nibbles(u) if bits == 4 else u
    s, m = torch.from_numpy(q.s), torch.from_numpy(q.m)
    file = torch.from_numpy(gguf.quants.dequantize(raw, qt))
    for dtype in (torch.float16, torch.float32):
        for rows in (1, 7, 64):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
            y = qlinear(x, u, s, m, bits)
            want = x.float() @ file.t()
            ref = reference_qlinear(x, u, s, m, bits)
            out.append(dict(name=name, dtype=str(dtype), rows=rows, out_dtype=str(y.dtype), shape=list(y.shape),
                            err=float((y.float() - want).abs().max() / want.abs().max()),
                            ref_err=float((ref - want).abs().max() / want.abs().max())))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_triton_kernel_computes_each_gguf_type_as_the_file_dequantizes_it(results):
    assert len(results) == 4 * 2 * 3
    for r in results:
        print(r)
        tol = 2e-3 if r["dtype"] == "torch.float16" else 2e-5  # float16 tiles round the weights
        assert r["err"] <= tol, r
        assert r["ref_err"] <= 2e-5, r  # the torch reference itself is the file's weight
        assert r["out_dtype"] == r["dtype"] and r["shape"] == [r["rows"], 96]
