"""The tensor-parallel sum over the GPUs' peer memory, fused with the norm after it
(``kernels.fused.rms_norm`` with ``peers``), against NCCL's all-reduce and the torch norm: on
two GPUs, eagerly and replayed in CUDA graphs, rows of every count interleaved, so that each
row's generation count and its three buffer slots are exercised as the decode steps use them, with
parts that hold -0.0 (the buffers' mark of an unwritten element)."""

from __future__ import annotations

import socket

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _rank(rank: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from neuron.models.layers import Collectives
    from neuron.models.ops import TorchOps
    from neuron.runner.ops import TritonOps

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank,
                            device_id=device)
    rows, n, dtype = 64, 4096, torch.bfloat16
    ops, comm = TritonOps(TorchOps()), Collectives(2)
    how = comm.use_peer_memory(rows, n, dtype, device, ops)
    weight = (torch.rand(n, device=device, generator=torch.Generator(device=device).manual_seed(7)) + 0.5).to(dtype)
    worst, mismatches, calls, apart = 0.0, 0, 0, 0

    def check(x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor, new: torch.Tensor) -> None:
        nonlocal worst, mismatches, calls, apart
        total = x.float()
        dist.all_reduce(total)
        want_res = residual.float() + total.to(dtype).float()
        want_out = TorchOps().rms_norm(want_res.to(dtype), weight, 1e-6)
        mismatches += int((new != want_res.to(dtype)).sum())
        worst = max(worst, float((out.float() - want_out.float()).abs().max()))
        both = [torch.empty_like(out) for _ in range(2)]
        dist.all_gather(both, out)
        apart += int((both[0] != both[1]).sum())  # every rank holds the same bits
        calls += 1

    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    for i, t in enumerate([1, 3, 64, 17, 1, 1, 2, 64, 5] * 12):
        x = torch.randn(t, n, device=device, generator=gen).to(dtype)
        if i % 3 == 0:  # -0.0 marks an unwritten element in the peer buffers: a part may hold it
            x[:, i % 5::5] = -0.0
        residual = torch.randn(t, n, device=device, generator=torch.Generator(device=device).manual_seed(i)).to(dtype)
        before = residual.clone()
        out, new = ops.reduce_add_rms_norm(x, residual, weight, 1e-6, comm)
        check(x, before, out, new)

    # A graph of 8 sums in a chain (as a step's layers), replayed between eager sums.
    static_x = torch.zeros(8, n, device=device, dtype=dtype)
    static_res = torch.zeros(8, n, device=device, dtype=dtype)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        h, res = ops.reduce_add_rms_norm(static_x, static_res, weight, 1e-6, comm)  # warm-up, as capture does
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = static_res
        for k in range(8):
            h, res = ops.reduce_add_rms_norm(static_x * (k + 1), res, weight, 1e-6, comm)
    for i in range(20):
        static_x.copy_(torch.randn(8, n, device=device, generator=gen).to(dtype))
        static_res.copy_(torch.randn(8, n, device=device, generator=torch.Generator(device=device).manual_seed(i)))
        want_res = static_res.clone()
        graph.replay()
        for k in range(8):
            total = (static_x * (k + 1)).float()
            dist.all_reduce(total)
            want_res = (want_res.float() + total.to(dtype).float()).to(dtype)
            want_h = TorchOps().rms_norm(want_res, weight, 1e-6)
        mismatches += int((res != want_res).sum())
        worst = max(worst, float((h.float() - want_h.float()).abs().max()))
        t = 1 + i % 7
        x = torch.randn(t, n, device=device, generator=gen).to(dtype)
        residual = torch.randn(t, n, device=device, generator=torch.Generator(device=device).manual_seed(99 + i))
        residual = residual.to(dtype)
        before = residual.clone()
        out, new = ops.reduce_add_rms_norm(x, residual, weight, 1e-6, comm)
        check(x, before, out, new)
    torch.cuda.synchronize(device)
    results[rank] = (how, worst, mismatches, calls, apart)
    dist.destroy_process_group()


@pytest.mark.skipif(_gpus() < 2, reason="needs two NVIDIA GPUs")
@pytest.mark.timeout(300)
def test_the_sum_in_the_norm_over_peer_memory_equals_nccl_and_the_torch_norm():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    mp.spawn(_rank, args=(port, results), nprocs=2)
    for rank in range(2):
        how, worst, mismatches, calls, apart = results[rank]
        assert how.startswith("peer memory"), how
        assert calls == 128
        assert mismatches == 0, f"rank {rank}: {mismatches} residual values differ from NCCL's sum"
        assert worst <= 0.0625, f"rank {rank}: the norm is off by {worst}"
        assert apart == 0, f"rank {rank}: {apart} values of the norm differ between the ranks"
