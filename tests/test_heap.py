"""The serving process's memory settings, in a process of their own (they are process-wide)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

SETTLED = """
import gc, json
from neuron import heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a

startup = [Node() for _ in range(1000)]
cycle()
before = gc.get_threshold()
heap.settle_collector()
frozen = gc.get_freeze_count()
cycle()  # garbage made while serving is still collected
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": frozen,
                  "collected": gc.collect()}))
"""


def test_the_settled_collector_skips_the_startup_heap_and_still_collects_new_cycles():
    import json

    out = subprocess.run([sys.executable, "-c", SETTLED], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    from neuron.heap import GEN0

    assert got["before"][0] < GEN0 and got["after"] == [GEN0, *got["before"][1:]]
    assert got["frozen"] >= 1000  # the startup objects, out of every later collection
    assert got["collected"] >= 2  # the cycle made after
