"""The CUDA C++ 4-bit product (``neuron/kernels/packed_mma.py``, compiled by NVRTC) on a GPU, on
shapes the format tests do not reach: W rows not a multiple of a warp's tile, an odd number of
128-column chunks, more rows of x than a launch takes, every config the tuner may pick, both
scale words (float16 pairs with c = 8, float32 pairs with a zero point); held to the exact
weights rounded once, as ``test_gpu_packed.py`` holds every format. Also: a CUDA graph replays
it bit for bit, the split of K sums in a fixed order, and the compiled kernel comes back from
the disk cache in a new process, and is compiled again where the cached file is damaged (its
SHA-256 no longer matches: the driver never sees it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no NVIDIA GPU visible")


def _weight(N: int, K: int, zero_points: bool, seed: int = 3):
    from neuron.kernels.packed_scales import coarsen_scales, pair_scales

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g)
    s = (torch.rand(N, K // 32, generator=g) * 0.02 + 0.001).half()
    if zero_points:  # AWQ's: m = -s z, float32 pairs per 128 columns
        s = s[:, ::4].repeat_interleave(4, 1)
        m = -s.float() * torch.randint(0, 16, (N, K // 128), generator=g).repeat_interleave(4, 1)
        sm = coarsen_scales(pair_scales(s.float(), m))
    else:  # in-situ q4's and Q4_0's: float16 pairs, r = m + 8 s a 16-bit float
        m = (-8 * s.float()).half()
        sm = pair_scales(s, m)
    grouped = q.view(N, K // 32, 2, 16)
    u = (grouped[:, :, 0] | grouped[:, :, 1] << 4).to(torch.uint8).view(N, K // 2)
    gs = K // sm.shape[1]
    w = q.double().view(N, -1, gs) * sm[..., 0].double()[..., None] + sm[..., 1].double()[..., None]
    return u.cuda(), sm.cuda(), w.view(N, K).cuda()


def _rel(a, b) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


@needs_gpu
@pytest.mark.parametrize("zero_points", [False, True], ids=["float16-pairs", "zero-points"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_config_gives_the_exact_weights_rounded_once(zero_points, dtype):
    from neuron.kernels import packed_mma as pm
    from neuron.kernels.packed_scales import scale_words, unpack_modes

    N, K = 200, 384
    u, sm, w = _weight(N, K, zero_points)
    words, mode = scale_words(sm), unpack_modes(sm.cpu(), 4)[dtype]
    assert mode in ("fast", "split")
    w16 = w.to(dtype).double()
    failed = []
    for M in (1, 5, 8, 13, 33, 64, 100):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to("cuda", dtype)
        want = x.double() @ w16.t()
        assert pm.supported(x, 4, K, words.shape[1], mode)
        for config in [None, *(c[1:] for c in pm.candidates(M))]:
            y = torch.full((M, N), float("nan"), device="cuda")
            pm.qmma(x, u, words, y, mode, config)
            if not _rel(y, want) <= 2e-5:
                failed.append((M, config, _rel(y, want)))
        y16 = pm.qmma(x, u, words, torch.empty(M, N, device="cuda", dtype=dtype), mode)
        ulp = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
        if not _rel(y16, want.to(dtype).double()) <= 2 * ulp:
            failed.append((M, "16-bit out", _rel(y16, want.to(dtype).double())))
    assert not failed


@needs_gpu
def test_a_graph_replays_it_and_the_split_sums_in_a_fixed_order():
    from neuron.kernels import packed_mma as pm
    from neuron.kernels.packed_scales import scale_words

    N, K, M = 1024, 4096, 8
    u, sm, _ = _weight(N, K, False)
    words = scale_words(sm)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    config = (2, 1, 2, 4, 3, 16)  # 16 parts of K
    eager = pm.qmma(x, u, words, torch.empty(M, N, device="cuda"), "split", config)
    again = pm.qmma(x, u, words, torch.empty(M, N, device="cuda"), "split", config)
    assert torch.equal(eager, again)
    y = torch.empty(M, N, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pm.qmma(x, u, words, y, "split", config)
    for _ in range(3):
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager)
    assert pm.supported(x, 4, K, words.shape[1], "float") is False
    assert pm.supported(x.float(), 4, K, words.shape[1], "split") is False
    assert pm.supported(x, 8, K, words.shape[1], "split") is False
    assert pm.supported(x, 4, K, K // 16, "split") is False  # the K-quants' half groups
    assert pm.supported(x[:, :4000], 4, 4000, 125, "split") is False


_CHILD = """
import json, logging, sys, torch
logging.basicConfig(level=logging.WARNING)
from neuron.kernels import nvrtc
from neuron.kernels import packed_mma as pm
from neuron.kernels.packed_scales import scale_words
sys.path.insert(0, "tests")
from test_gpu_mma import _weight
calls = []
real = nvrtc.compile_source
nvrtc.compile_source = lambda *a: calls.append(a[1]) or real(*a)
u, sm, w = _weight(256, 512, False)
x = torch.randn(8, 512, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
y = pm.qmma(x, u, scale_words(sm), torch.empty(8, 256, device="cuda"), "split", (2, 1, 2, 4, 3))
err = float((y.double() - x.double() @ w.to(torch.bfloat16).double().t()).abs().max() / y.abs().max())
print(json.dumps({"compiled": calls, "err": err}))
"""


@needs_gpu
def test_the_compiled_kernel_comes_from_the_disk_cache_and_a_damaged_one_is_rebuilt(tmp_path):
    env = {**os.environ, "NEURON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}

    def child():
        proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr

    first, _ = child()
    assert first["compiled"] == ["w4mma<2, 1, 2, 4, 3, false, true, false>"] and first["err"] < 2e-5
    cubins = list((tmp_path / "cuda").glob("*.cubin"))
    assert len(cubins) == 1 and (tmp_path / "cuda").stat().st_mode & 0o777 == 0o700
    second, _ = child()
    assert second["compiled"] == [] and second["err"] == first["err"]
    cubins[0].write_bytes(cubins[0].read_bytes()[:100])  # truncated
    third, log = child()
    assert third["compiled"] == ["w4mma<2, 1, 2, 4, 3, false, true, false>"] and third["err"] == first["err"]
    assert "is damaged; compiled again" in log
