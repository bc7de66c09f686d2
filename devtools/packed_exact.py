"""The GPU's packed products against the exact math of their integers (``w = s q + m`` in
float64, from the scales and zero points the format holds), row count by row count and config by
config: the check ``tests/test_gpu_packed.py`` runs, and a table to read.

    python -m devtools.packed_exact [--dtype bfloat16] [--json]

For each format (in-situ q4 and q8_0, AWQ's and GPTQ's zero points with float16 scales per 128
columns, GGUF Q4_0, Q4_1, Q4_K and Q6_K) and each row count it reports the served product's largest error,
as a share of the largest output, against

- ``exact``: ``x W^T`` with W exact (what no kernel with 16-bit operands can reach), and
- ``weights``: ``x W'^T`` with W' the exact weights each rounded once to the activations' dtype
  (the dequantized model the parity tests compare against), rounded to that dtype like the output.

Where the product runs on the tensor cores (``GEMV_ROWS`` < rows <= ``GEMM_ROWS``) every config
the load-time tuner may pick is run too, with a float32 output, against ``x W'^T`` in float64:
only the order of the float32 sums may differ there (``tile_err``). Up to ``GEMV_ROWS`` rows the
decode kernel multiplies int8 activations, so it is held to ``x' W^T`` with ``x'`` those
(``int8_err``); past ``GEMM_ROWS`` the weight is unpacked whole and must be W' bit for bit."""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

ROWS = (1, 2, 8, 9, 16, 33, 64, 65, 128, 129, 256, 2048)
N, K = 384, 1024
# where every config the tuner may pick is run too (each compiles a kernel): the 4-bit products with
# a zero point (AWQ) and with an offset (in-situ q4), at the rows where their tiles differ
EVERY_CONFIG = {("awq", 1), ("awq", 16), ("awq", 64), ("q4", 8), ("q4", 64)}


def formats(rng: np.random.Generator) -> dict:
    """name -> QuantWeight of N x K."""
    import gguf

    from devtools.checkpoints import random_quant_blocks
    from neuron.models.quant import GROUP, QuantWeight, SuperScales, decode_blocks, quantize

    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    out = {"q4": quantize(torch.from_numpy(w), "q4"), "q8_0": quantize(torch.from_numpy(w), "q8_0")}
    for name in ("Q4_0", "Q4_1"):
        qt = gguf.GGMLQuantizationType[name]
        out[name] = decode_blocks(gguf.quants.quantize(w, qt), qt)
    for name in ("Q4_K", "Q6_K"):  # a scale per 16 columns, exact in float32
        out[name] = decode_blocks(random_quant_blocks(name, (N, K), rng), gguf.GGMLQuantizationType[name])
    for name, bits in (("awq", 4), ("gptq8", 8)):  # as loader/published.py reads them: s float16 per
        # 128 columns, m = -s z exact in float32 (z kept as an int8 times -s)
        groups = K // 128
        s = (rng.random((N, groups)) * 0.01 + 0.001).astype(np.float16)
        z = rng.integers(0, 2 ** bits if bits == 4 else 128, (N, groups)).astype(np.int8)
        per = 128 // GROUP
        s32 = np.repeat(s, per, 1).astype(np.float32)
        mn = np.repeat(z, per, 1)
        dm = (-s32).astype(np.float16)
        m32 = dm.astype(np.float32) * mn.astype(np.float32)
        u = rng.integers(0, 2 ** bits, (N, K)).astype(np.uint8)
        sup = SuperScales(np.ones(mn.shape, np.int8), mn, np.repeat(s, per, 1), dm)
        out[name] = QuantWeight(u, s32, m32, bits, name, GROUP, sup)
    return out


def exact_weight(q) -> torch.Tensor:
    u = torch.from_numpy(q.u.astype(np.float64)).view(N, -1, q.group)
    s = torch.from_numpy(q.s.astype(np.float64))[..., None]
    m = torch.from_numpy(q.m.astype(np.float64))[..., None]
    return (u * s + m).view(N, K)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def run(dtype: torch.dtype, names: list[str] | None = None, emit=None) -> list[dict]:
    from neuron.kernels import packed as tk
    from neuron.kernels import packed_gemm as tg
    from neuron.kernels import packed_mma as pm
    from neuron.kernels.quantized_rows import reference_quantized_rows
    from neuron.kernels.packed_scales import scale_words
    from neuron.models.packed_linear import PackedLinear
    from neuron.runner.linear import PACKED_BATCH_CANDIDATES, PACKED_CANDIDATES, split_candidates

    device = torch.device("cuda")
    rows_out = []
    for name, q in formats(np.random.default_rng(11)).items():
        if names and name not in names:
            continue
        lin = PackedLinear(q, None, dtype, device)
        w64 = exact_weight(q).to(device)
        w16 = w64.to(dtype)
        unpacked = tk.dequantize(lin.u, lin.sm, lin.bits, dtype)
        for M in ROWS:
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M), dtype=torch.float64).to(device, dtype)
            y = lin(x)
            want = x.double() @ w16.double().t()
            mma_ok = M <= pm.MMA_ROWS and pm.supported(x, lin.bits, K, lin.sm.shape[1], lin.unpack[dtype])
            mma = mma_ok and M in pm.MMA_DEFAULT_ROWS  # the product served by default
            path = "mma" if mma else "decode" if M <= tk.GEMV_ROWS else "tensor cores" if M <= tg.GEMM_ROWS else "unpacked"
            row = dict(format=name, bits=lin.bits, dtype=str(dtype).removeprefix("torch."), rows=M,
                       exact=rel(y, x.double() @ w64.t()), weights=rel(y, want.to(dtype)), path=path)
            errs = []
            if mma_ok:  # the CUDA C++ product, every config the tuner may pick, float32 out
                for config in [None, *(c[1:] for c in pm.candidates(M))]:
                    y32 = torch.empty(M, N, device=device, dtype=torch.float32)
                    pm.qmma(x, lin.u, scale_words(lin.sm), y32, lin.unpack[dtype], config)
                    errs.append(rel(y32, want))
            if M <= tk.GEMV_ROWS:  # int8 rows times the exact weights, in float32 (the decode kernel's configs)
                want_q = (reference_quantized_rows(x).double() @ w64.t()).to(dtype)
                block = 1 << (M - 1).bit_length()
                configs = (PACKED_CANDIDATES if M == 1 else PACKED_BATCH_CANDIDATES) if (name, M) in EVERY_CONFIG else ()
                configs = (None, *configs)
                row["int8_err"] = max(rel(tk.qlinear(x, lin.u, lin.sm, lin.bits, None, c and {block: c}), want_q)
                                      for c in configs)
            elif M <= tg.GEMM_ROWS:  # Triton's tensor-core product (the tuner may pick it), float32 out
                words = scale_words(lin.sm)
                every = (name, M) in EVERY_CONFIG and dtype == torch.bfloat16
                for config in [None, *(split_candidates(N, K, M, device) if every else ())]:
                    y32 = torch.empty(M, N, device=device, dtype=torch.float32)
                    tg.qgemm(x, lin.u, words, lin.bits, y32, config, lin.unpack[dtype])
                    errs.append(rel(y32, want))
            if errs:
                row["tile_err"] = max(errs)
                row["configs"] = len(errs)
                row["unpack"] = lin.unpack[dtype]
            if M > tg.GEMM_ROWS:
                row["unpacked_equal"] = bool(torch.equal(unpacked, w16))
            rows_out.append(row)
            if emit:
                emit(row)
    return rows_out


def line(r: dict) -> str:
    extra = r.get("tile_err", r.get("int8_err", "equal" if r.get("unpacked_equal") else "DIFFERS"))
    extra = f"{extra:10.2e}" if isinstance(extra, float) else f"{extra:>10}"
    return (f"{r['format']:8} {r['dtype']:9} {r['rows']:5d} {r['path']:13} {r['exact']:9.2e} {r['weights']:9.2e} "
            f"{extra} {r.get('configs', '')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16,float16")
    ap.add_argument("--formats", help="only these (comma-separated)")
    ap.add_argument("--json", action="store_true", help="one JSON list on the last line")
    args = ap.parse_args()
    names = args.formats.split(",") if args.formats else None
    if not args.json:
        print(f"{'format':8} {'dtype':9} {'rows':>5} {'path':13} {'exact':>9} {'weights':>9} {'tile/int8':>10} configs",
              flush=True)
    emit = None if args.json else (lambda r: print(line(r), flush=True))
    rows = [r for d in args.dtype.split(",") for r in run(getattr(torch, d), names, emit)]
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
