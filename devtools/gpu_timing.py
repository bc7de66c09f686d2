"""Timing a GPU call as a decode step runs it: captured in a CUDA graph and replayed."""

from __future__ import annotations

import math

import torch


def graph_ms(fn, reps: int = 20) -> float:
    """GPU milliseconds per call: ``reps`` calls captured in one CUDA graph and replayed five
    times, after three warm calls (timed from the host, a small kernel measures its launch)."""
    for _ in range(3):
        fn()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps / 5


def copies(nbytes: int, cache_bytes: float = 240e6) -> int:
    """How many copies of a weight of ``nbytes`` make every call read it from memory (240 MB:
    four times an H200's L2 cache)."""
    return max(2, math.ceil(cache_bytes / nbytes))


class Turns:
    """Which copy the next call reads: 0, 1, ... ``n - 1``, 0, ..."""

    def __init__(self, n: int) -> None:
        self.n, self.at = n, 0

    def __call__(self) -> int:
        self.at = (self.at + 1) % self.n
        return self.at
