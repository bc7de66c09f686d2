"""Where a GPU step's time goes along its chain of kernels.

Under programmatic dependent launch (PDL) a kernel starts while the one before it still runs, so
kernel durations overlap and their sum is not the step. Here each kernel is charged its share of
the chain instead: its end minus the latest end of any kernel before it (in start order), or
nothing where it ends inside another's span. The shares and the idle gaps between kernels add up
to the span from the first kernel's start to the last one's end. ``scripts/profile-step --chain``
prints them per kernel (name and grid) from a torch.profiler trace of graph-replayed steps.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Kernel:
    name: str
    grid: tuple[int, ...]
    start: float  # microseconds
    duration: float


@dataclass(frozen=True)
class Share:
    name: str
    grid: tuple[int, ...]
    launches: int
    chain_us: float  # the kernel's share of the chain, all its launches
    busy_us: float  # its launches' durations added up


@dataclass(frozen=True)
class ChainReport:
    shares: list[Share]  # largest share first
    span_us: float  # first start to last end
    idle_us: float  # time no kernel ran


def kernel_events(trace: str | Path) -> list[Kernel]:
    """The GPU kernels of a chrome trace (``torch.profiler``'s ``export_chrome_trace``)."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    return [Kernel(e["name"], tuple(e.get("args", {}).get("grid", ())), float(e["ts"]), float(e["dur"]))
            for e in events if e.get("cat") == "kernel"]


def chain_shares(kernels: list[Kernel]) -> ChainReport:
    chain: defaultdict[tuple[str, tuple[int, ...]], float] = defaultdict(float)
    busy: defaultdict[tuple[str, tuple[int, ...]], float] = defaultdict(float)
    launches: Counter[tuple[str, tuple[int, ...]]] = Counter()
    last_end: float | None = None
    idle = 0.0
    for k in sorted(kernels, key=lambda k: k.start):
        key = (k.name, k.grid)
        end = k.start + k.duration
        if last_end is None:
            chain[key] += k.duration
        else:
            chain[key] += max(0.0, end - max(last_end, k.start))
            idle += max(0.0, k.start - last_end)
        busy[key] += k.duration
        launches[key] += 1
        last_end = end if last_end is None else max(last_end, end)
    shares = sorted((Share(name, grid, launches[(name, grid)], chain[(name, grid)], busy[(name, grid)])
                     for name, grid in chain), key=lambda s: -s.chain_us)
    span = (last_end - min(k.start for k in kernels)) if kernels else 0.0
    return ChainReport(shares, span, idle)


def format_report(report: ChainReport, steps: int, rows: int = 32) -> str:
    """The shares per step as a table, the largest ``rows`` of them."""
    lines = [f"chain {report.span_us / steps / 1e3:.3f} ms a step, of which idle {report.idle_us / steps / 1e3:.3f}",
             f"{'kernel':56s} {'grid':>16s} {'a step':>7s} {'chain us':>9s} {'busy us':>8s}"]
    for s in report.shares[:rows]:
        lines.append(f"{s.name[:56]:56s} {str(list(s.grid)):>16s} {s.launches / steps:7.2f} "
                     f"{s.chain_us / steps:9.1f} {s.busy_us / steps:8.1f}")
    return "\n".join(lines)
