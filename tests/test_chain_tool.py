"""devtools/chain.py: each kernel's share of a step's chain, from a chrome trace."""

from __future__ import annotations

import json

from devtools.chain import Kernel, chain_shares, format_report, kernel_events


def test_overlapping_kernels_are_charged_what_they_add_to_the_chain(tmp_path):
    """A starts first; B overlaps its end (PDL) and adds 2; a gap of 3; C runs 5 and D ends inside
    C (adds nothing); a second launch of B adds 1. Shares and idle time add up to the span."""
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "A", "ts": 0, "dur": 10, "args": {"grid": [4, 1, 1]}},
        {"cat": "kernel", "name": "B", "ts": 5, "dur": 7, "args": {"grid": [1, 1, 1]}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 30},  # not a kernel
        {"cat": "kernel", "name": "C", "ts": 15, "dur": 5, "args": {"grid": [2, 1, 1]}},
        {"cat": "kernel", "name": "D", "ts": 16, "dur": 2, "args": {"grid": [2, 1, 1]}},
        {"cat": "kernel", "name": "B", "ts": 19, "dur": 2, "args": {"grid": [1, 1, 1]}},
    ]}
    (tmp_path / "t.json").write_text(json.dumps(trace))
    kernels = kernel_events(tmp_path / "t.json")
    assert [k.name for k in kernels] == ["A", "B", "C", "D", "B"] and kernels[0].grid == (4, 1, 1)
    report = chain_shares(kernels)
    by_name = {s.name: s for s in report.shares}
    assert by_name["A"].chain_us == 10 and by_name["C"].chain_us == 5 and by_name["D"].chain_us == 0
    assert by_name["B"].chain_us == 3 and by_name["B"].launches == 2 and by_name["B"].busy_us == 9
    assert report.idle_us == 3 and report.span_us == 21
    assert sum(s.chain_us for s in report.shares) + report.idle_us == report.span_us
    assert [s.name for s in report.shares] == ["A", "C", "B", "D"]  # largest share first
    table = format_report(report, steps=3)
    assert "chain 0.007 ms a step, of which idle 0.001" in table and table.splitlines()[2].startswith("A ")


def test_the_same_kernel_at_two_grids_is_two_rows():
    report = chain_shares([Kernel("gemv", (8,), 0, 4), Kernel("gemv", (16,), 4, 6)])
    assert [(s.grid, s.chain_us) for s in report.shares] == [((16,), 6), ((8,), 4)]
    assert chain_shares([]).span_us == 0
