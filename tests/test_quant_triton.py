"""The Triton kernels for packed weights (GPU path), run by Triton's interpreter on the CPU
against the float32 torch reference: 4- and 8-bit integers, a scale per 32 or per 16, batches
1..256 (the three paths, whole and partial K steps), the real layouts of a GGUF tensor. The
decode rows (up to ``GEMV_ROWS``) multiply int8-quantized activations, so they are checked
against the reference product of those (``reference_quantized_rows``) and, looser, the file's.
The interpreter cannot multiply bfloat16 tiles (``tl.dot`` on bf16 returns garbage there, on
any kernel), so it checks float16 activations; bfloat16 runs the same code on the GPU."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import run_kernel_check

# Not imported here: a triton imported before tests/test_kernels.py sets TRITON_INTERPRET would
# leave that module's kernels half compiled, half interpreted (this file runs its kernels in
# subprocesses of their own).
if importlib.util.find_spec("triton") is None:
    pytest.skip("no triton", allow_module_level=True)


CHECK = r"""
import json, sys, numpy as np, torch, gguf
from neuron.models.packed_linear import pack_nibbles
from neuron.models.quant import decode_blocks
from neuron.kernels import packed as tk
from neuron.kernels import packed_gemm as tg
from neuron.kernels.quantized_rows import reference_quantized_rows
from neuron.kernels.packed import qlinear, reference_qlinear
from neuron.kernels.packed_scales import pair_scales
from devtools.checkpoints import random_quant_blocks
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
    u_all = (pack_nibbles(u) if bits == 4 else u).to(device)
    dt = torch.float32 if name.endswith("_K") else torch.float16  # as PackedLinear keeps them
    sm_all = pair_scales(torch.from_numpy(q.s).to(dt), torch.from_numpy(q.m).to(dt)).to(device)
    file = torch.from_numpy(gguf.quants.dequantize(raw, qt)).to(device)
    for dtype in dtypes:
        for rows in (1, 2, 3, 8, 9, 40, 65, 256):  # BLOCK_M 1, 2, 4 (row 3 masked), 8; the
            # tensor-core kernel at 16 and 64 rows a tile, and at 65 two tiles; unpacked for torch
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
            # The decode kernel on W's first 16 rows (a program per 1, 2 or 4 of them: the interpreter's
            # time goes with their number); the others on all 96 (a tensor-core tile of 64 and a partial one).
            n = 16 if rows <= tk.GEMV_ROWS else 96
            u, sm = u_all[:n], sm_all[:n]
            y = qlinear(x, u, sm, bits)
            # the LM head's float32 logits hold y's values: the decode kernel's store, and a conversion
            y32 = qlinear(x, u, sm, bits, out_dtype=torch.float32) if rows in (1, 9) else y.float()
            want = x.float() @ file[:n].t()
            ref = reference_qlinear(x, u, sm, bits)
            row = dict(name=name, dtype=str(dtype), rows=rows, out_dtype=str(y.dtype), shape=list(y.shape),
                       f32_same=y32.dtype == torch.float32 and torch.equal(y32, y.float()),
                       err=float((y.float() - want).abs().max() / want.abs().max()),
                       ref_err=float((ref - want).abs().max() / want.abs().max()))
            if rows <= tk.GEMV_ROWS:  # int8 activations: against their own product, and the file's
                want_q = reference_qlinear(reference_quantized_rows(x), u, sm, bits)
                row["err_q"] = float((y.float() - want_q).abs().max() / want_q.abs().max())
            if rows == 9:  # the tensor-core kernel (y above): K whole (K = 288) or in 2 parts by its own
                # choice (K = 512); here in 3 parts (at K = 512 the last is empty)
                tg.GEMM_SPLIT = 3
                row["err_split"] = float((qlinear(x, u, sm, bits).float() - want).abs().max() / want.abs().max())
                tg.GEMM_SPLIT = None
            if rows == 256:  # W unpacked in slices of 40 rows (the last 16), each product into its columns
                budget, tk.DEQUANT_BYTES = tk.DEQUANT_BYTES, 40 * K * x.element_size()
                row["err_slices"] = float((qlinear(x, u, sm, bits).float() - want).abs().max() / want.abs().max())
                tk.DEQUANT_BYTES = budget
            if rows == 1:  # tiles that divide the matrix and M == BLOCK_M: the loads of W and of x
                # without masks (at 2 and 8 rows the K-quants' K = 512 divides the default tiles)
                block, tk.GEMV_CONFIG[1] = tk.GEMV_CONFIG[1], (2, 16 if K % 512 == 0 else 1, 1)
                even = qlinear(x, u, sm, bits).float()
                tk.GEMV_CONFIG[1] = block
                row["err_even"] = float((even - want_q).abs().max() / want_q.abs().max())
            out.append(row)
print(json.dumps(out))
"""


def run_check(device: str, dtypes: str, interpret: bool) -> list[dict]:
    return run_kernel_check(CHECK, device, dtypes, interpret=interpret)


def check(results: list[dict], dtypes: int) -> None:
    assert len(results) == 4 * dtypes * 8
    for r in results:
        print(r)
        # float16 and bfloat16 tiles round the weights (8 and 11 significant bits)
        tol = {"torch.float16": 2e-3, "torch.bfloat16": 1.6e-2}.get(r["dtype"], 2e-5)
        assert r.get("err_q", r["err"]) <= tol and r.get("err_even", 0.0) <= tol, r
        assert r.get("err_split", 0.0) <= tol and r.get("err_slices", 0.0) <= tol, r
        assert ("err_slices" in r) == (r["rows"] == 256), r
        assert r["err"] <= (3e-2 if "err_q" in r else tol), r  # int8 activations: 0.4-0.7% measured here
        assert r["ref_err"] <= 2e-5, r  # the torch reference itself is the file's weight
        n = 16 if r["rows"] <= 8 else 96  # GEMV_ROWS: the decode kernel's rows
        assert r["out_dtype"] == r["dtype"] and r["shape"] == [r["rows"], n] and r["f32_same"], r


def test_the_triton_kernel_computes_each_gguf_type_as_the_file_dequantizes_it():
    check(run_check("cpu", "float16", interpret=True), 1)  # the GPU test adds bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no NVIDIA GPU visible")
def test_the_compiled_kernels_on_a_gpu():
    check(run_check("cuda", "bfloat16,float16", interpret=False), 2)
    check_gemm(run_kernel_check(GEMM, "cuda", "bfloat16,float16", interpret=False), 2)
    assert all(r["same"] for r in run_kernel_check(COARSE, "cuda", interpret=False))


GEMM = r"""
import json, sys, torch
from neuron.kernels import packed as tk
from neuron.kernels import packed_gemm as tg
from neuron.kernels.packed_scales import coarsen_scales, pair_scales
device = sys.argv[1]
dtypes = [getattr(torch, d) for d in sys.argv[2].split(",")]
g = torch.Generator().manual_seed(5)
out = []
# (N, K): tiles that divide W (no masks) and ones that do not; 4 and 8 bits; a pair of scales per
# 32 columns, and per 128 (AWQ, GPTQ)
for (N, K), bits, per in (((128, 256), 4, 1), ((80, 160), 4, 1), ((128, 256), 8, 1), ((128, 512), 4, 4)):
    u = torch.randint(0, 256, (N, K * bits // 8), generator=g, dtype=torch.uint8)
    s = (torch.rand(N, K // 32 // per, generator=g) * 0.01).half().float()
    m = -s * torch.randint(0, 2 ** bits, s.shape, generator=g).float()
    sm = coarsen_scales(pair_scales(s.repeat_interleave(per, 1).half(), m.repeat_interleave(per, 1).half()))
    u, sm = u.to(device), sm.to(device)
    for dtype in dtypes:
        for rows, config, split in ((4, (128, 64, 4, 3), None), (9, None, None), (16, (64, 64, 4, 3), 3),
                                    (33, None, 2), (64, (128, 128, 4, 3, 2), None)):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
            tg.GEMM_SPLIT = split
            key = rows if rows <= tk.GEMV_ROWS else max(16, 1 << (rows - 1).bit_length())
            configs = {key: config} if config else None
            y = tk.qlinear(x, u, sm, bits, configs=configs)
            again = tk.qlinear(x, u, sm, bits, configs=configs)
            tg.GEMM_SPLIT = None
            want = tk.reference_qlinear(x, u, sm, bits)
            row = dict(N=N, K=K, bits=bits, per=per, dtype=str(dtype), rows=rows, split=split,
                       err=float((y.float() - want).abs().max() / want.abs().max()),
                       same=torch.equal(y, again), shape=list(y.shape) == [rows, N] and y.dtype == dtype)
            if rows == 4:  # the LM head's float32 logits: the decode kernel's, whatever the config
                y32 = tk.qlinear(x, u, sm, bits, configs=configs, out_dtype=torch.float32)
                row["f32"] = float((y32 - want).abs().max() / want.abs().max())
            out.append(row)
print(json.dumps(out))
"""


def check_gemm(results: list[dict], dtypes: int) -> None:
    assert len(results) == 4 * dtypes * 5
    for r in results:
        tol = {"torch.float16": 2e-3, "torch.bfloat16": 1.6e-2}[r["dtype"]]
        assert r["err"] <= tol and r["same"] and r["shape"] and r.get("f32", 0.0) <= 3e-2, r


def test_the_tensor_core_kernel_for_batches_of_decodes():
    """The packed product of 4 to 64 rows on the tensor cores (``packed_gemm``): W's tiles whole
    or masked, K in parts added in the kernel (the same sums every run), configs the tuner may
    choose, scales per 32 or per 128 columns."""
    check_gemm(run_kernel_check(GEMM, "cpu", "float16", interpret=True), 1)


COARSE = r"""
import json, sys, torch
from neuron.kernels import packed as tk
from neuron.kernels.packed_scales import coarsen_scales, pair_scales
device = sys.argv[1]
g = torch.Generator().manual_seed(3)
out = []
for bits, per in ((4, 4), (8, 2)):  # groups of 128 and of 64 columns
    N, K = 96, 512
    u = torch.randint(0, 256, (N, K * bits // 8), generator=g, dtype=torch.uint8)
    s = (torch.rand(N, K // 32 // per, generator=g) * 0.01).half().float()
    m = -s * torch.randint(0, 2 ** bits, s.shape, generator=g).float()
    fine = pair_scales(s.repeat_interleave(per, 1), m.repeat_interleave(per, 1))
    coarse = coarsen_scales(fine)
    u, fine, coarse = u.to(device), fine.to(device), coarse.to(device)
    row = dict(bits=bits, shape=list(coarse.shape), kept=coarsen_scales(fine[:, 1:]).shape == fine[:, 1:].shape)
    row["dequant"] = torch.equal(tk.dequantize(u, coarse, bits, torch.float16), tk.dequantize(u, fine, bits, torch.float16))
    same = row["dequant"]
    for rows in (1, 9, 65, 129):  # the decode kernel, the tensor-core kernel (one tile of rows, two),
        # unpacked for torch
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(device, torch.float16)
        same = same and torch.equal(tk.qlinear(x, u, coarse, bits), tk.qlinear(x, u, fine, bits))
    row["same"] = bool(same) and row["shape"] == [N, K // 32 // per, 2] and row["kept"]
    out.append(row)
print(json.dumps(out))
"""


def test_scales_kept_per_128_columns_give_the_same_products_as_per_32():
    """AWQ and GPTQ releases scale 128 columns a pair: on the GPU the pairs are kept that way
    (``coarsen_scales``), and every kernel reads them to the same products, bit for bit."""
    results = run_kernel_check(COARSE, "cpu", interpret=True)
    assert len(results) == 2 and all(r["same"] for r in results), results


