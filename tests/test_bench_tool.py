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
