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
        if r["path"] in ("tensor cores", "mma"):  # float32 out, every config: only the sums' order differs
            ok = r["weights"] <= 2 * ulp and r["tile_err"] <= 2e-5 and r.get("int8_err", 0) <= 2 * ulp
        elif r["path"] == "unpacked":
            ok = r["weights"] <= 2 * ulp and r["unpacked_equal"]
        else:  # int8 activations times the exact weights, every decode config
            ok = r["int8_err"] <= 2 * ulp and r["weights"] <= 0.02 and r.get("tile_err", 0) <= 2e-5
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
    assert gpu.u.is_cuda, "the GPU's integers stay on it"
    gpu = gpu.on_host()
    for name in ("u", "s", "m"):
        assert np.array_equal(getattr(cpu, name), getattr(gpu, name)), name


@needs_gpu
def test_in_situ_fp8_on_the_gpu_gives_the_cpu_s_values_and_scales():
    """A rank quantizes to FP8 on its GPU: the same e4m3 values and float32 scales as the CPU's,
    and they stay on the GPU."""
    from neuron.models.fp8 import quantize_fp8

    g = torch.Generator().manual_seed(9)
    w = (torch.randn(512, 1024, generator=g) * torch.logspace(-6, 2, 512)[:, None]).to(torch.bfloat16)
    cpu, gpu = quantize_fp8(w), quantize_fp8(w, device=torch.device("cuda"))
    assert gpu.values.is_cuda and gpu.scale.is_cuda
    assert torch.equal(cpu.values.view(torch.uint8), gpu.values.cpu().view(torch.uint8))
    assert torch.equal(cpu.scale, gpu.scale.cpu()) and torch.equal(cpu.col_block, gpu.col_block)


@needs_gpu
@pytest.mark.parametrize("scheme", ["q4", "q8_0"])
def test_a_packed_matrix_built_from_the_gpu_s_integers_is_the_host_built_one(scheme):
    """In-situ integers stay on the GPU and are packed there: the same packed words, scale pairs
    and unpack modes as a matrix built from the host's integers, a fused one whose parts came from
    both included (a vocabulary padded with host zero rows)."""
    import numpy as np

    from neuron.models.packed_linear import PackedLinear
    from neuron.models.quant import QuantWeight, concat_rows, quantize

    cuda = torch.device("cuda")
    w = (torch.randn(384, 512, generator=torch.Generator().manual_seed(6)) * 0.05).to(torch.bfloat16)
    zeros = QuantWeight(np.zeros((64, 512), np.uint8), np.zeros((64, 16), np.float32),
                        np.zeros((64, 16), np.float32), 4 if scheme == "q4" else 8, "")
    host = PackedLinear(concat_rows([quantize(w[:256], scheme), quantize(w[256:], scheme), zeros]), None,
                        torch.bfloat16, cuda)
    parts = [quantize(w[:256], scheme, cuda), quantize(w[256:], scheme, cuda), zeros]
    device = PackedLinear(concat_rows(parts), None, torch.bfloat16, cuda)
    assert torch.equal(host.u, device.u) and torch.equal(host.sm, device.sm)
    assert host.unpack == device.unpack
    x = torch.randn(5, 512, device=cuda, dtype=torch.bfloat16)
    assert torch.equal(host(x), device(x))


@needs_gpu
@pytest.mark.parametrize("fmt", ["awq", "gptq4", "gptq8", "gptq4-act"])
def test_published_integers_unpacked_on_the_gpu_pack_as_the_host_s_do(tmp_path, fmt):
    """A rank unpacks an AWQ or GPTQ checkpoint's words on its GPU: whole weights and shares of
    rows and of columns give the same packed matrices as the host's unpacking, and the same floats."""
    from test_published_quant import FORMATS, write_quantized

    from devtools.checkpoints import make_checkpoint
    from neuron.loader.published import PublishedSource
    from neuron.loader.safetensors_source import SafetensorsSource
    from neuron.loader.spec import load_spec
    from neuron.models.packed_linear import PackedLinear

    cuda = torch.device("cuda")
    d = write_quantized(make_checkpoint("qwen3", tmp_path / "qwen3", seed=17), tmp_path / fmt, *FORMATS[fmt])
    spec = load_spec(str(d))
    files = SafetensorsSource(spec.files.paths)
    host, gpu = PublishedSource(files, spec.checkpoint_quant), PublishedSource(files, spec.checkpoint_quant, cuda)
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        for share in ({}, {"dim": 0, "part": range(16, 48)}, {"dim": 1, "part": range(32, 64)}):
            a, b = host.get_quant(name, **share), gpu.get_quant(name, **share)
            assert not torch.is_tensor(a.u) and b.u.is_cuda
            pa, pb = PackedLinear(a, None, torch.bfloat16, cuda), PackedLinear(b, None, torch.bfloat16, cuda)
            assert torch.equal(pa.u, pb.u) and torch.equal(pa.sm, pb.sm) and pa.unpack == pb.unpack, (name, share)
            assert torch.equal(host.get(name, **share), gpu.get(name, **share)), (name, share)


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
