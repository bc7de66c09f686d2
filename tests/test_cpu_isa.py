"""The CPU kernels at every instruction-set level: built at install time (a first start compiles
nothing), each level this machine runs computing every GGUF type as the file dequantizes it, the
plain C++ check of the kernels' arithmetic natively and (for Arm NEON, which this machine cannot
run) under qemu-user, and ``NEURON_CPU_ISA`` forcing a level or refused by name where the CPU
lacks it, with the level shown in ``GET /models`` and the load log."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import gguf
import httpx
import numpy as np
import pytest
import torch

from conftest import DEFAULT_MODEL, ROOT, SMALL, start_server
from neuron.kernels import cpu, isa
from neuron.kernels.cpu import KernelUnavailable, load_level
from neuron.kernels.quantized_rows import reference_quantized_rows
from neuron.models.packed_linear import PackedLinear, host_tensors
from neuron.models.quant import decode_blocks
from test_quant import raw_tensor

RUNNABLE = [level.name for level in isa.runnable()]
CSRC = ROOT / "neuron" / "kernels" / "csrc"
CHECK = ROOT / "tests" / "csrc" / "kernel_check.cpp"


def level_kernels(name: str):
    try:
        return load_level(name)
    except KernelUnavailable as exc:
        pytest.skip(str(exc))


# ---------------------------------------------------------------------------- built at install
def test_every_level_of_this_architecture_is_built_and_a_first_start_compiles_nothing(server_tmp):
    """Every level importable; then a start with an empty home (no cache of any build to find),
    no compiler on the PATH and ``NEURON_CPU_ISA`` forcing the second-best level: it serves, on
    that level, named in ``GET /models`` and the load log."""
    built = [lv.name for lv in isa.levels_for() if importlib.util.find_spec(f"neuron.kernels.{isa.module_name(lv.name)}")]
    assert built == [lv.name for lv in isa.levels_for()], built
    assert RUNNABLE and RUNNABLE[-1] == "portable" and isa.choose().name == RUNNABLE[0]
    forced = RUNNABLE[-2] if len(RUNNABLE) > 1 else RUNNABLE[0]  # not what it would choose
    home, bare = server_tmp / "empty-home", server_tmp / "no-compiler-bin"
    home.mkdir(exist_ok=True)
    bare.mkdir(exist_ok=True)
    env = {"HOME": str(home), "PATH": str(bare), "TORCH_EXTENSIONS_DIR": str(home / "ext"), "NEURON_CPU_ISA": forced}
    server = start_server(server_tmp, config=SMALL, env=env)
    try:
        models = httpx.get(f"{server.url}/models", timeout=10).json()["models"]
        assert models[0]["cpu_isa"] == forced, models[0]
        assert f"CPU kernels {forced}" in server.log()
        r = httpx.post(f"{server.base}/chat/completions", timeout=60, json={
            "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert not (home / "ext").exists()  # nothing built: no compiler on the PATH, no cache
    finally:
        server.stop()


# ----------------------------------------------------------------------- every level, every type
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")


def int16_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int16 products take it (``csrc/qblock.h``): per group of 32, q = round(x / d)
    half away from zero, d = max|x| / 32767, the quotient taken as x * (32767 / max|x|) in float32."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    q = (g * (torch.full_like(amax, 32767.0) / amax)).double()  # a true division (32767 / t is by t's reciprocal)
    q = torch.where(amax > 0, torch.sign(q) * torch.floor(q.abs() + 0.5), 0)
    return (q * (amax / 32767.0).double()).view_as(x)


def activation_forms(level: str) -> tuple[str, ...]:
    return ("float32", "int8", "int16") if next(x for x in isa.LEVELS if x.name == level).int8 else ("float32",)


@pytest.mark.parametrize("level", RUNNABLE)
@pytest.mark.parametrize("name", TYPES)
def test_each_level_computes_each_gguf_type_as_the_file_dequantizes_it(level, name, monkeypatch):
    """1 to 130 rows of x (a decode, a batch of decodes, prompt chunks: from GEMM_ROWS on through
    the dequantized W and torch's GEMM, whole and in panels), against the float32 product of the
    weight gguf-py's own dequantization gives, on a matrix of an odd row count: with x as it is,
    and, where the level multiplies x in integers, with x as its int8 or int16 form gives it, each
    row then as it would come alone. The int16 products take W in blocks of 16 rows: 80 of them."""
    N, K = 83, 512
    raw = raw_tensor(name, (N, K), np.random.default_rng(7))
    w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])).double()
    level_kernels(level)  # built, or skipped
    for activations in activation_forms(level):
        C = load_level(level, activations)
        assert C.int8_rows == (activations == "int8")
        n = 80 if activations == "int16" else N
        kernel = C.packed(*host_tensors(decode_blocks(raw[:n], gguf.GGMLQuantizationType[name])))
        assert kernel.blocked == (activations == "int16")
        cases = [(rows, whole) for rows in (1, 2, 5, 8, 9, 31, 64, cpu.GEMM_ROWS, 130) for whole in (True, False)
                 if whole or rows >= cpu.GEMM_ROWS]
        for rows, whole in cases:
            monkeypatch.setattr(cpu, "PANEL_BYTES", cpu.PANEL_BYTES if whole else 4 * K * 32)  # 3 panels of W
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
            form = {"int8": reference_quantized_rows, "int16": int16_rows}.get(activations, lambda x: x)
            want = form(x).double() @ w[:n].t()
            got = kernel(x)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            assert float((got.double() - want).abs().max()) <= 3e-6 * float(want.abs().max()), (level, name, rows, whole)
            if activations != "float32":
                assert torch.equal(torch.cat([kernel(x[r:r + 1]) for r in range(rows)]), got), (level, name, rows)


@pytest.mark.parametrize("level", RUNNABLE)
@pytest.mark.parametrize("name", TYPES)
def test_a_blocked_weight_gives_back_the_rows_and_panels_the_file_holds(level, name):
    """The int16 products' copy of W in blocks of 16 rows (``csrc/qblock.h``) dequantizes, by row
    index (an embedding lookup) and by panel (``dequantized``), to the very values the rows as the
    file holds them give; and a weight of a row count blocks cannot hold stays as it is, its
    products taking x in float32."""
    if "int16" not in activation_forms(level):
        pytest.skip(f"the {level} kernels multiply in float32 only")
    raw = raw_tensor(name, (96, 256), np.random.default_rng(11))
    tensors = host_tensors(decode_blocks(raw, gguf.GGMLQuantizationType[name]))
    plain = load_level(level, "float32").packed(*tensors)
    blocked = load_level(level, "int16").packed(*tensors)
    assert blocked.blocked and not torch.equal(blocked.tensors[0], tensors[1])  # a copy, reordered
    ids = torch.tensor([0, 95, 17, 17, 64, 3])
    assert torch.equal(blocked.rows(ids), plain.dequantized(0, 96)[ids])
    assert torch.equal(blocked.dequantized(16, 80), plain.dequantized(16, 80))
    with pytest.raises(RuntimeError, match="out of range"):
        blocked.rows(torch.tensor([96]))
    odd = load_level(level, "int16").packed(*host_tensors(decode_blocks(raw[:40], gguf.GGMLQuantizationType[name])))
    x = torch.randn(3, 256)
    assert not odd.blocked and torch.equal(odd(x), load_level(level, "float32").packed(odd.bits, *odd.tensors)(x))


@pytest.mark.parametrize("level", RUNNABLE)
def test_a_nan_or_infinity_in_x_spoils_its_own_rows_products_only(level):
    level_kernels(level)
    raw = raw_tensor("Q4_0", (48, 256), np.random.default_rng(3))
    for activations in activation_forms(level):
        kernel = load_level(level, activations).packed(*host_tensors(decode_blocks(raw, gguf.GGMLQuantizationType.Q4_0)))
        for rows in (3, cpu.GEMM_ROWS):
            x = torch.randn(rows, 256)
            x[1, 70], x[2, 200] = float("nan"), float("inf")
            y = kernel(x)
            assert torch.isfinite(y[0]).all() and y[1].isnan().all() and not torch.isfinite(y[2]).any(), activations
            assert torch.isfinite(y[3:]).all(), (activations, rows)


def test_integer_activations_are_the_default_where_the_level_has_them_and_refused_by_name_where_not(monkeypatch):
    by_name = {lv.name: lv for lv in isa.LEVELS}
    assert isa.activations(by_name["avx2"], "") == "int16" and isa.activations(by_name["avx512vnni"], "") == "int16"
    assert isa.activations(by_name["neon"], "") == "float32" and isa.activations(by_name["portable"], "") == "float32"
    assert isa.activations(by_name["avx512"], "int8") == "int8" and isa.activations(by_name["avx2"], "INT8 ") == "int8"
    assert isa.activations(by_name["avx2"], "float32") == "float32"
    for form in ("int8", "int16"):
        with pytest.raises(isa.IsaError, match=f"NEURON_CPU_ACTIVATIONS={form}: the portable kernels"):
            isa.activations(by_name["portable"], form)
    with pytest.raises(isa.IsaError, match="not one of int16, int8, float32"):
        isa.activations(by_name["avx2"], "int4")
    monkeypatch.setenv(isa.ACTIVATIONS_ENV, "int8")
    assert isa.activations(by_name["avx2"]) == "int8"
    code = "from neuron.kernels.cpu import cpu_kernels; cpu_kernels()"  # what a rank and the registry call
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, isa.ACTIVATIONS_ENV: "int4"})
    assert out.returncode != 0 and "NEURON_CPU_ACTIVATIONS='int4'" in out.stderr, out.stderr[-2000:]


def test_a_product_refuses_what_does_not_fit_its_weight():
    C = level_kernels(RUNNABLE[0])
    q = decode_blocks(raw_tensor("Q4_1", (8, 64), np.random.default_rng(1)), gguf.GGMLQuantizationType.Q4_1)
    lin = PackedLinear(q, None)
    kernel = C.packed(4, lin.u, lin.s, lin.m, lin.d, lin.dm)
    for bad in (torch.zeros(2, 32), torch.zeros(2, 64, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="x must be float32"):
            kernel(bad)
    with pytest.raises(RuntimeError, match="scales do not match u"):
        C.packed(4, lin.u, lin.s[:4], lin.m, lin.d, lin.dm)


# ------------------------------------------------------------------- the C++ check of each level
def _check(cmd: list[str], run: list[str]) -> str:
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("level", RUNNABLE)
def test_the_kernels_arithmetic_checks_out_in_plain_cpp_at_each_level(level, tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler here")
    lv = next(x for x in isa.LEVELS if x.name == level)
    exe = tmp_path / f"check-{level}"
    out = _check(["g++", *isa.COMMON_FLAGS, *lv.flags, f"-DNEURON_ISA_{level.upper()}", f"-I{CSRC}", str(CHECK),
                  "-o", str(exe)], [str(exe)])
    assert out.startswith(f"ok {level} ") and int(out.split()[2]) > 150, out


@pytest.mark.parametrize("level", ["neon", "portable"])
def test_the_arm_levels_check_out_under_emulation(level, tmp_path):
    """This machine cannot run Arm code: Debian's aarch64 cross compiler builds the check,
    qemu-user runs it. That shows the NEON source right; its speed cannot be measured here."""
    if platform_machine() == "aarch64":
        pytest.skip("an Arm machine runs its levels natively (the test above)")
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64") or shutil.which(
        "qemu-aarch64-static")
    if cxx is None or qemu is None:
        pytest.skip("needs Debian's g++-aarch64-linux-gnu and qemu-user (apt-get install g++-aarch64-linux-gnu "
                    "qemu-user)")
    lv = next(x for x in isa.LEVELS if x.name == level)
    exe = tmp_path / f"check-arm-{level}"
    out = _check([cxx, *isa.COMMON_FLAGS, *lv.flags, "-static", f"-DNEURON_ISA_{level.upper()}", f"-I{CSRC}",
                  str(CHECK), "-o", str(exe)], [qemu, str(exe)])
    assert out.startswith(f"ok {level} ") and int(out.split()[2]) > 150, out


def platform_machine() -> str:
    import platform

    return platform.machine()


# ----------------------------------------------------------------------------- NEURON_CPU_ISA
X86 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c", "sse2"}


def test_the_best_level_the_cpu_reports_is_chosen_and_a_forced_one_is_refused_by_name_where_it_cannot_run():
    assert isa.choose(X86, "", "x86_64").name == "avx512"
    assert isa.choose(X86 | {"avx512_vnni"}, "", "x86_64").name == "avx512vnni"
    assert isa.choose(X86 | {"avx512_vnni"}, "avx512", "x86_64").name == "avx512"
    assert isa.choose({"avx2", "fma", "f16c"}, "", "x86_64").name == "avx2"
    assert isa.choose({"avx2", "fma", "f16c", "avx_vnni"}, "", "x86_64").name == "avx2vnni"  # Alder Lake, no AVX-512
    assert isa.choose(X86 | {"avx_vnni"}, "", "x86_64").name == "avx512"
    assert isa.choose({"avx2", "fma"}, "", "x86_64").name == "portable"  # no F16C: no AVX2 level
    assert isa.choose({"fp", "asimd"}, "", "aarch64").name == "neon"
    assert isa.choose(set(), "", "riscv64").name == "portable"
    assert isa.choose(X86, "avx2", "x86_64").name == "avx2"
    assert isa.choose(X86, "PORTABLE", "x86_64").name == "portable"
    with pytest.raises(isa.IsaError, match="NEURON_CPU_ISA=avx512: this CPU lacks avx512f, avx512bw"):
        isa.choose({"avx2", "fma", "f16c"}, "avx512", "x86_64")
    with pytest.raises(isa.IsaError, match="NEURON_CPU_ISA=avx512vnni: this CPU lacks avx512_vnni"):
        isa.choose(X86, "avx512vnni", "x86_64")
    with pytest.raises(isa.IsaError, match="its levels are avx512vnni, avx512, avx2vnni, avx2, portable"):
        isa.choose(X86, "neon", "x86_64")
    with pytest.raises(isa.IsaError, match="'sse9' is not a level"):
        isa.choose(X86, "sse9", "x86_64")
    assert isa.cpu_features("processor: 0\nflags\t\t: fpu avx2 fma f16c\n") == {"fpu", "avx2", "fma", "f16c"}
    assert isa.cpu_features("Features\t: fp asimd evtstrm asimddp\n") == {"fp", "asimd", "evtstrm", "asimddp"}


def test_a_level_the_cpu_lacks_stops_the_daemon_naming_it(server_tmp):
    wrong = next(lv.name for lv in isa.LEVELS if lv.name not in RUNNABLE)  # another architecture's, or more
    server = start_server(server_tmp, config=SMALL, env={"NEURON_CPU_ISA": wrong}, healthy=False)
    assert server.proc.wait(120) != 0
    assert f"NEURON_CPU_ISA={wrong}" in server.log(), server.log()[-2000:]
    code = "from neuron.kernels.cpu import cpu_kernels; cpu_kernels()"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "NEURON_CPU_ISA": wrong})
    assert out.returncode != 0 and f"NEURON_CPU_ISA={wrong}" in out.stderr
