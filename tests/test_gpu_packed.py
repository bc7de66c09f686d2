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


@needs_gpu
@pytest.mark.parametrize("scheme", ["q4", "q8_0"])
def test_in_situ_quantization_on_the_gpu_gives_the_cpu_s_integers_and_scales(scheme):
    """A rank quantizes in situ on its GPU: the same integers and scales as the CPU computes, on
    weights of every magnitude (groups near 0, far from 0, constant, tiny)."""
    import numpy as np

    from neuron.models.quant import quantize

    g = torch.Generator().manual_seed(5)
    w = torch.randn(512, 1024, generator=g) * torch.logspace(-6, 2, 512)[:, None]
    w[::7] += torch.randn(74, 1, generator=g) * 40  # groups far from 0
    w[3::11, :64] = 0.125  # constant groups
    w = w.to(torch.bfloat16)
    cpu, gpu = quantize(w, scheme), quantize(w, scheme, torch.device("cuda"))
    for name in ("u", "s", "m"):
        assert np.array_equal(getattr(cpu, name), getattr(gpu, name)), name


@needs_gpu
def test_a_second_load_takes_every_tuner_choice_from_the_tuning_cache(tmp_path, monkeypatch):
    """The tuner times the candidates at the first load of a q4 model and writes its choices; the
    second load of the same model times nothing and gives every packed weight the same configs."""
    from test_quant import config_of

    from devtools.checkpoints import make_checkpoint
    from devtools.parity import ParityJob, build
    from neuron.models.tp_linear import packed_parts
    from neuron.runner import linear

    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path / "cache"))
    d = make_checkpoint("qwen3", tmp_path / "qwen3", seed=31)
    paths = [str(p) for p in sorted(d.glob("*.safetensors"))]
    job = ParityJob("q4", "safetensors", paths, config_of("safetensors", paths), [[1, 2, 3]] * 8,
                    dtype="bfloat16", quant="q4", device="cuda")
    timings = []
    for name in ("_time", "_graph_ms"):  # counted on the way to the real timers
        real = getattr(linear, name)
        monkeypatch.setattr(linear, name, lambda *a, real=real, **kw: timings.append(1) or real(*a, **kw))
    loads = []
    for _ in range(2):
        before = len(timings)
        runner, _ = build(job)
        loads.append(([dict(p.configs) for p in packed_parts(runner.model)], len(timings) - before))
        del runner
        torch.cuda.empty_cache()
    (first, timed), (second, again) = loads
    assert timed > 0 and again == 0
    assert first == second
    assert len(list((tmp_path / "cache" / "tuning").glob("*.json"))) == 1
