"""The tensor-parallel sum inside the norm's kernel (``kernels.fused.rms_norm`` with ``peers``)
between real processes on the CPU: Triton's interpreter runs the same kernel source the GPUs
compile, each rank's buffer a shared file that every rank maps (as the GPUs map each other's
memory), so the protocol between the ranks (the generation per row, the slots, the waits) is
checked in CI. The GPUs' memory model and NVLink are not: tests/test_gpu_peer.py checks those.

Rows of every count interleaved, as the decode and prompt steps use them: every rank's residual
equals the sum of the parts in rank order plus the old residual, bit for bit, and its norm the
torch norm's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported, here and in the ranks
pytest.importorskip("triton")

WORLD, ROWS, N = 3, 8, 96
COUNTS = [1, 3, 8, 2, 1, 1, 5, 8, 7, 1, 4, 2]


def _rank(rank: int, folder: str, barrier, results) -> None:
    import torch

    from neuron.kernels.fused import rms_norm
    from neuron.models.layers import PeerRows
    from neuron.models.ops import TorchOps

    dtype = torch.float32
    size = PeerRows.nbytes(ROWS, N, dtype, WORLD)
    maps = [torch.from_file(str(Path(folder) / f"rank{p}"), shared=True, size=size, dtype=torch.uint8)
            for p in range(WORLD)]
    peers = PeerRows.over([m.data_ptr() for m in maps], maps[rank], rank, WORLD, ROWS, N, dtype)
    barrier.wait()  # every buffer is clear
    weight = torch.rand(N, generator=torch.Generator().manual_seed(5)) + 0.5
    mismatches, worst = 0, 0.0
    for i, t in enumerate(COUNTS):
        parts = [torch.randn(t, N, generator=torch.Generator().manual_seed(100 * i + p)) for p in range(WORLD)]
        if i % 3 == 0:  # parts may hold -0.0 (a product's, a silu's)
            for part in parts:
                part[:, i % 5::5] = -0.0
        residual = torch.randn(t, N, generator=torch.Generator().manual_seed(i))
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        want = residual + total
        out, new = rms_norm(parts[rank].clone(), weight, 1e-6, residual.clone(), peers=peers)
        mismatches += int((new != want).sum())
        worst = max(worst, float((out - TorchOps().rms_norm(want, weight, 1e-6)).abs().max()))
    results[rank] = (mismatches, worst, peers.gens.tolist())


@pytest.mark.timeout(300)
def test_the_sum_in_the_norm_between_processes_equals_the_sum_in_rank_order(tmp_path):
    import torch
    import torch.multiprocessing as mp

    from neuron.models.layers import PeerRows

    size = PeerRows.nbytes(ROWS, N, torch.float32, WORLD)
    for p in range(WORLD):
        (tmp_path / f"rank{p}").write_bytes(b"\xff" * size)  # not clear until its rank clears it
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    results, barrier = manager.dict(), manager.Barrier(WORLD)
    mp.start_processes(_rank, args=(str(tmp_path), barrier, results), nprocs=WORLD, start_method="spawn")
    rows_used = [sum(t > r for t in COUNTS) for r in range(ROWS)]
    for rank in range(WORLD):
        mismatches, worst, gens = results[rank]
        assert mismatches == 0, f"rank {rank}: {mismatches} residual values differ from the sum in rank order"
        assert worst < 1e-5, f"rank {rank}: the norm is off by {worst}"
        assert gens == rows_used, f"rank {rank}: each row counts its sums"
