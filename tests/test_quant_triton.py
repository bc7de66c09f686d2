"""The Triton kernels for packed weights (GPU path), run by Triton's interpreter on the CPU
against the float32 torch reference: 4- and 8-bit integers, a scale per 32 or per 16, batches
1..65 (the three paths, whole and partial K steps), the real layouts of a GGUF tensor. The interpreter cannot multiply bfloat16 tiles
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
import json, sys, numpy as np, torch, gguf
from neuron.models.quant import decode_blocks, pack_nibbles
from neuron.models import triton_kernels as tk
from neuron.models.triton_kernels import qlinear, reference_qlinear
from neuron.tools.checkpoints import random_quant_blocks
device = sys.argv[1]
dtypes = [getattr(torch, d) for d in sys.argv[2].split(",")]
rng = np.random.default_rng(7)
out = []
for name in ("Q4_1", "Q8_0", "Q4_K", "Q6_K"):
    qt = gguf.GGMLQuantizationType[name]
    K = 512 if name.endswith("_K") else 288  # super-blocks of 256; 288 leaves a partial K step
    raw = random_quant_blocks(name, (96, K), rng) if name.endswith("_K") else gguf.quants.quantize(
        (rng.standard_normal((96, K)) * 0.1).astype(np.float32), qt)
    q = decode_blocks(raw, qt)
    bits = 4 if q.bits <= 4 else 8
    u = torch.from_numpy(q.u)
    u = (pack_nibbles(u) if bits == 4 else u).to(device)
    s, m = torch.from_numpy(q.s).to(device), torch.from_numpy(q.m).to(device)
    file = torch.from_numpy(gguf.quants.dequantize(raw, qt)).to(device)
    for dtype in dtypes:
        for rows in (1, 3, 4, 7, 64, 65):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
            y = qlinear(x, u, s, m, bits)
            want = x.float() @ file.t()
            ref = reference_qlinear(x, u, s, m, bits)
            row = dict(name=name, dtype=str(dtype), rows=rows, out_dtype=str(y.dtype), shape=list(y.shape),
                       err=float((y.float() - want).abs().max() / want.abs().max()),
                       ref_err=float((ref - want).abs().max() / want.abs().max()))
            if rows == 7:  # the tensor-core kernel, which takes only wide matrices
                tk.WIDE_N, default = 0, tk.WIDE_N
                row["err_gemm"] = float((qlinear(x, u, s, m, bits).float() - want).abs().max() / want.abs().max())
                tk.WIDE_N = default
            if rows == 1:  # tiles that divide the matrix: the loads without masks
                tk.GEMV_CONFIG[1], default = (2, 32, 1), tk.GEMV_CONFIG[1]
                even = qlinear(x, u, s, m, bits).float()
                tk.GEMV_CONFIG[1] = default
                row["err_even"] = float((even - want).abs().max() / want.abs().max())
            out.append(row)
print(json.dumps(out))
"""


def run_check(device: str, dtypes: str, interpret: bool) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", CHECK, device, dtypes], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(results: list[dict], dtypes: int) -> None:
    assert len(results) == 4 * dtypes * 6
    for r in results:
        print(r)
        # float16 and bfloat16 tiles round the weights (8 and 11 significant bits)
        tol = {"torch.float16": 2e-3, "torch.bfloat16": 1.6e-2}.get(r["dtype"], 2e-5)
        assert r["err"] <= tol and r.get("err_even", 0.0) <= tol and r.get("err_gemm", 0.0) <= tol, r
        assert r["ref_err"] <= 2e-5, r  # the torch reference itself is the file's weight
        assert r["out_dtype"] == r["dtype"] and r["shape"] == [r["rows"], 96]


def test_the_triton_kernel_computes_each_gguf_type_as_the_file_dequantizes_it():
    check(run_check("cpu", "float16,float32", interpret=True), 2)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no NVIDIA GPU visible")
def test_the_compiled_kernels_on_a_gpu():
    check(run_check("cuda", "bfloat16,float16", interpret=False), 2)


TC4 = r"""
import json, sys, torch
from neuron.models import triton_kernels as tk
from neuron.models.quant import pack_nibbles
device = sys.argv[1]
dtype = torch.bfloat16 if device == "cuda" else torch.float32
g = torch.Generator().manual_seed(3)
out = []
for N, K in ((24, 256), (16, 96), (40, 192)):  # the three packings: 8, 2 and 4 k-tiles to a word
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    s = torch.rand(N, K // 32, generator=g) * 0.02
    m = -torch.rand(N, K // 32, generator=g) * 0.1
    ikt = 8 if K % 128 == 0 else 4 if K % 64 == 0 else 2
    row = dict(N=N, K=K, ikt=ikt)
    if device == "cuda":
        mine = tk.reference_tc4_pack(q, ikt)
        theirs = torch._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).cuda(), ikt).cpu()
        row["same_layout"] = bool(torch.equal(mine, theirs))
        w = tk.Tc4Weight.build(q.cuda(), s.cuda(), m.cuda())
    else:
        w = tk.Tc4Weight.build(q, s, m, pack=tk.reference_tc4_pack)
    sz = w.sz.float().cpu()  # the weight the kernels compute from: scales and offsets in bf16
    dense = ((q.float().view(N, -1, 32) - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]).view(N, K)
    ids = torch.tensor([N - 1, 0, 5, 5, 9])
    row["rows_err"] = float((w.rows(ids.to(device), torch.float32).cpu() - dense[ids]).abs().max())
    for M in ([1, 5, tk.TC4_ROWS] if device == "cuda" else []) + [tk.TC4_ROWS + 1, 200]:
        x = torch.randn(M, K, generator=g)
        y = w(x.to(device, dtype)).float().cpu()
        want = x.to(dtype).float() @ dense.t()
        row[f"err_{M}"] = float((y - want).abs().max() / want.abs().max())
    out.append(row)
print(json.dumps(out))
"""


def run_tc4(device: str, interpret: bool) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", TC4, device], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in results:
        print(r)
        assert r["rows_err"] <= 1e-6, r  # the unpacked rows are the packed weight's
        for key, err in r.items():
            if key.startswith("err_"):  # float32 on the CPU; bf16 products and outputs on the GPU
                assert err <= (1.6e-2 if device == "cuda" else 1e-5), (key, r)
    return results


def test_the_tensor_core_int4_layout_unpacks_to_its_weight():
    """The layout torch's int4 kernel reads, as ``reference_tc4_pack`` writes it: unpacked rows
    (the embedding lookup) and the products of more rows than that kernel takes (unpacked,
    then a dense product), under the interpreter."""
    run_tc4("cpu", interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no NVIDIA GPU visible")
def test_the_tensor_core_int4_layout_is_torchs_on_a_gpu():
    """``reference_tc4_pack`` is what ``torch._convert_weight_to_int4pack`` makes, so the CPU test
    above checks the layout the GPU kernel reads; torch's kernel computes the packed weight."""
    results = run_tc4("cuda", interpret=False)
    assert all(r["same_layout"] for r in results)
