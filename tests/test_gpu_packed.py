"""The packed products on a GPU agree with the weights they were given: every format the loaders
keep packed, every path (decode kernel, tensor cores with every config the tuner may pick, the
weight unpacked for cuBLAS), row counts 1 to 2,048, against the exact math of the format's own
integers, scales and zero points (``devtools/packed_exact.py``).

The bar is the dequantized model's: each weight the exact ``s q + m`` rounded once to the
activations' dtype. A kernel that rounds a scale or an offset to bfloat16 on the way (as the
tensor-core kernel did: an AWQ offset ``-s z`` of 8 bits moved every weight of its group of 128
together, and AWQ models agreed with their own weights on 95.8% of tokens) misses it by orders of
magnitude; the order of float32 sums does not."""

from __future__ import annotations

import pytest

from conftest import run_kernel_check

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no NVIDIA GPU visible")

CHECK = "import sys; sys.argv += ['--json']; from devtools.packed_exact import main; main()"


@needs_gpu
def test_packed_products_on_a_gpu_are_the_exact_weights_rounded_once():
    rows = run_kernel_check(CHECK, interpret=False)
    assert {r["format"] for r in rows} == {"q4", "q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "awq", "gptq8"}
    failed = []
    for r in rows:
        ulp = 2 ** -8 if r["dtype"] == "bfloat16" else 2 ** -11  # the output's own rounding
        if r["path"] == "tensor cores":  # float32 out, every config: only the sums' order differs
            ok = r["weights"] <= 2 * ulp and r["tile_err"] <= 2e-5
        elif r["path"] == "unpacked":
            ok = r["weights"] <= 2 * ulp and r["unpacked_equal"]
        else:  # int8 activations times the exact weights, every decode config
            ok = r["int8_err"] <= 2 * ulp and r["weights"] <= 0.02
        print(r)
        if not ok:
            failed.append(r)
    assert not failed
    assert sum(r.get("configs", 0) > 2 for r in rows) >= 3  # the tuner's configs ran
