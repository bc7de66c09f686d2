"""How the tensor-core kernel unpacks each packed format (``packed_scales.unpack_modes``), and
that its 16-bit arithmetic (``packed_gemm._asm``, emulated here in float64 with one rounding per
FMA, as the GPU's ``fma.rn`` rounds) gives each weight the exact ``s q + m`` rounded once to the
activations' dtype: the same weights as the dequantized model, bit for bit. Where it could not
(arbitrary offsets: Q4_1, Q4_K), the mode is "float". The compiled kernel itself is checked on a
GPU by tests/test_gpu_packed.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from devtools.packed_exact import exact_weight, formats
from neuron.kernels.packed_scales import coarsen_scales, pair_scales, unpack_modes


def kernel_scales(q) -> torch.Tensor:
    """The pairs a PackedLinear on a GPU keeps for ``q``."""
    scales = [torch.from_numpy(t if q.sup is not None else t.astype(np.float16)) for t in (q.s, q.m)]
    return coarsen_scales(pair_scales(*scales))


def emulated(q, sm: torch.Tensor, dt: torch.dtype, split: bool) -> torch.Tensor:
    """The weights ``_asm`` makes from ``group_operands``' operands, in float64 with each FMA
    rounded once to ``dt``."""
    def rnd(t):
        return t.to(dt).double()

    s, m = sm[..., 0].double(), sm[..., 1].double()
    per = q.u.shape[1] // s.shape[1]
    s, m = s.repeat_interleave(per // 32, 1)[..., None], m.repeat_interleave(per // 32, 1)[..., None]
    if sm.dtype == torch.float32:
        c = torch.where(s == 0, 0.0, torch.clamp(torch.floor(-m / torch.where(s == 0, 1.0, s) + 0.5), -112, 112))
    else:
        c = torch.full_like(s, 8.0)
    r = rnd((m.float() + c.float() * s.float()).double())
    s_hi = rnd(s)
    s_lo = rnd(s - s_hi)
    d = torch.from_numpy(q.u.astype(np.float64)).view(q.u.shape[0], -1, 32) - c
    w = rnd(d * s_hi + rnd(d * s_lo + r)) if split else rnd(d * s_hi + r)
    return w.view(q.u.shape)


MODES = {  # format: (bfloat16, float16)
    "q4": ("fast", "fast"), "awq": ("split", "fast"), "Q4_0": ("split", "fast"), "Q4_1": ("float", "float"),
    "Q4_K": ("float", "float"), "q8_0": ("fast", "fast"), "gptq8": ("fast", "float"), "Q6_K": ("fast", "float"),
}


@pytest.mark.parametrize("name", sorted(MODES))
def test_each_format_unpacks_to_its_exact_weights_rounded_once(name):
    q = formats(np.random.default_rng(11))[name]
    sm = kernel_scales(q)
    modes = unpack_modes(sm, 4 if q.bits <= 4 else 8)
    assert (modes[torch.bfloat16], modes[torch.float16]) == MODES[name]
    for dt in (torch.bfloat16, torch.float16):
        if q.bits > 4 or modes[dt] == "float" or q.group != 32:
            continue
        want = exact_weight(q).to(dt).double()
        assert torch.equal(emulated(q, sm, dt, modes[dt] == "split"), want), (name, dt)
        if modes[dt] == "split":  # the FMA it saves elsewhere is needed here
            assert not torch.equal(emulated(q, sm, dt, False), want)
