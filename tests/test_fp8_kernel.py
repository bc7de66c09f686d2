"""The FP8 tensor-core kernels (``neuron/kernels/fp8.py``), run by Triton's interpreter on the
CPU (and compiled, where a GPU with FP8 tensor cores is visible) against the torch definition
``reference_fp8_linear``: x quantized to e4m3 per row and group of columns, each group's product
scaled by its row's and its weight column's scales. Blocks of 128 and 64 columns and one scale a
row; 1 to 130 rows (the fused decode kernel, split along K or not, and quantize-then-multiply);
partial tiles everywhere; e4m3 rounding (ties to even, subnormals, the largest value) as torch
converts."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import run_kernel_check

if importlib.util.find_spec("triton") is None:
    pytest.skip("no triton", allow_module_level=True)


CHECK = r"""
import json, sys, torch
from neuron.kernels import fp8 as k
device = sys.argv[1]
out = {"rows": [], "group_of_32": k.activation_group(256, 32)}
g = torch.Generator().manual_seed(3)
# every e4m3 value, the midpoints between neighbours (ties), and points either side of them
grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
grid = grid[grid.isfinite()].unique()
mid = (grid[1:] + grid[:-1]) / 2
vals = torch.cat([grid, mid, mid * (1 + 1e-6), mid * (1 - 1e-6), torch.rand(4000, generator=g) * 896 - 448])
vals = vals[vals.abs() <= 448]
x = torch.zeros(1, 128 * (-(-len(vals) // 128)))
x[0, :len(vals)] = vals
x[0, 127::128] = 448.0  # each group's max|x| is 448, so d = 1 and q is x rounded
q, s = k.quantize_rows_fp8(x.to(device), 128)
want = x.to(torch.float8_e4m3fn)
out["rounding_mismatches"] = int((q.cpu().float() != want.float()).sum())
out["scales_one"] = bool(torch.all(s.cpu() == 1.0))
for dtype in [getattr(torch, d) for d in sys.argv[2].split(",")]:
    for (M, N, K, group) in [(1, 96, 256, 128), (3, 80, 1024, 128), (16, 64, 256, 64), (40, 200, 384, 1 << 30),
                             (64, 130, 256, 128), (65, 130, 384, 128), (130, 72, 192, 64)]:
        x = (torch.randn(M, K, generator=g) * 3).to(dtype)
        x[0, : min(K, 128)] = 0  # a group of zeros
        w = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        G = min(group, K)
        ws = torch.rand(-(-K // G), N, generator=g) * 0.01
        bk = k.activation_group(K, G)
        y = k.fp8_linear(x.to(device), w.to(device), ws.to(device), G, bk).cpu()
        y32 = k.fp8_linear(x.to(device), w.to(device), ws.to(device), G, bk, out_dtype=torch.float32).cpu()
        ref = k.reference_fp8_linear(x, w, ws, G, bk)
        split = 1
        if M <= k.FUSED_ROWS:  # the split fp8_linear chose
            bm, bn, _, _, per_sm = k.WIDE_CONFIG if N >= k.WIDE_N else k.FUSED_CONFIG
            split = k.gemm_split(-(-N // bn) * -(-M // bm), K // bk, per_sm, torch.device(device))
        out["rows"].append(dict(M=M, N=N, K=K, G=G, bk=bk, dtype=str(dtype), out_dtype=str(y.dtype),
                                split=split, err32=float((y32 - ref).abs().max() / ref.abs().max()),
                                err=float((y.float() - ref).abs().max() / ref.abs().max())))
if device == "cuda" and k.blockwise_ok(torch.device(device)):  # cuBLAS's block-scaled product, odd rows
    out["cublas"] = []
    for M in (17, 2046):
        x = torch.randn(M, 512, generator=g).to(torch.bfloat16).cuda()
        w = (torch.randn(384, 512, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
        blocks = (torch.rand(3, 4, generator=g) * 0.01).cuda()
        ws = blocks.t().repeat_interleave(128, 1).contiguous()
        ref = k.reference_fp8_linear(x, w, ws, 128, 128)
        y = k.fp8_linear(x, w, ws, 128, 128, out_dtype=torch.float32, blocks=blocks)
        out["cublas"].append(float((y - ref).abs().max() / ref.abs().max()))
print(json.dumps(out))
"""


def run_check(device: str, dtypes: str, interpret: bool) -> dict:
    return run_kernel_check(CHECK, device, dtypes, interpret=interpret)


def check(result: dict, dtypes: int, exact: bool) -> None:
    print(result)
    assert all(err <= 1e-2 for err in result.get("cublas", [])), result.get("cublas")  # out in bf16
    assert result["group_of_32"] == 0  # weights in groups of 32 columns are unpacked instead
    assert result["rounding_mismatches"] == 0 and result["scales_one"]
    assert len(result["rows"]) == 7 * dtypes
    assert any(r["split"] > 1 for r in result["rows"])  # the split-K path ran
    for r in result["rows"]:
        assert r["out_dtype"] == r["dtype"], r
        # the same products, summed in another order; on Hopper, products of 64 rows and more
        # (its warp-group MMA) add with fewer bits than float32 (1.9e-4 measured on an H200)
        assert r["err32"] <= (1e-5 if exact or r["M"] <= 16 else 1e-3), r
        assert r["err"] <= {"torch.float16": 1e-3, "torch.bfloat16": 8e-3}[r["dtype"]], r  # y's own rounding


def test_the_fp8_kernels_compute_the_torch_definition():
    check(run_check("cpu", "float16,bfloat16", interpret=True), 2, exact=True)


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available()
                    or __import__("torch").cuda.get_device_capability() < (8, 9), reason="no GPU with FP8 tensor cores")
def test_the_compiled_fp8_kernels_on_a_gpu():
    result = run_check("cuda", "bfloat16,float16", interpret=False)
    check(result, 2, exact=False)
    assert "cublas" in result or not hasattr(__import__("torch").nn.functional, "scaled_mm")
