"""scripts/bench against a real server: the streams split over client processes, and each level's
busiest client process's CPU share, flagged where the client may be the limit."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import DEFAULT_MODEL, ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from perf_serve import CLIENT_BUSY, client  # noqa: E402


def test_a_level_reports_its_client_processes_and_their_busiest_cpu_share(tp1, tmp_path):
    out = tmp_path / "levels.jsonl"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench"), "--url", tp1.base, "--model", DEFAULT_MODEL,
                          "--concurrency", "1,2", "--requests", "2", "--max-tokens", "4", "--workers", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    one, two = [json.loads(line) for line in out.read_text().splitlines()]
    assert (one["workers"], two["workers"]) == (1, 2)  # never more processes than streams
    for row in (one, two):
        assert 0 < row["client_cpu"] < 1.5 and row["output_tok_s"] > 0
    assert "client" in run.stdout.splitlines()[0]
    assert client({"client_cpu": CLIENT_BUSY}) == f"{100 * CLIENT_BUSY:.0f}%*" and client({"client_cpu": 0.1}) == "10%"
    assert client({}) == ""  # a row from before the check


def test_the_cpu_bench_refuses_a_ratio_against_a_peer_built_without_the_cpus_instruction_sets():
    """scripts/bench-cpu-quant reads the peer's instruction sets from llama.cpp's own system-info
    line: a native comparison needs every one this CPU has; the AVX2 comparison needs AVX2 and no
    AVX-512, so both servers run the same instruction set."""
    import runpy

    bench = runpy.run_path(str(ROOT / "scripts" / "bench-cpu-quant"), run_name="bench_cpu_quant")
    native = bench["peer_isa"]("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | "
                               "AVX512_VNNI = 0 | OPENMP = 1 | REPACK = 1 |")
    avx2 = bench["peer_isa"]("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | OPENMP = 1 |")
    assert {"avx2", "avx512"} <= native and "avx512_vnni" not in native and "avx512" not in avx2
    refusal = bench["peer_refusal"]
    assert refusal("avx2", avx2) is None
    assert "avx512" in refusal("avx2", native)
    cpu = bench["cpu_isa"]()
    assert (refusal("native", avx2) is None) == ("avx512" not in cpu)
    assert refusal("native", native | cpu) is None
    # neuron's native level fuses its integer sums with VNNI where the CPU has it: so must the peer
    assert (refusal("native", native) is None) == ("avx512_vnni" not in cpu)
