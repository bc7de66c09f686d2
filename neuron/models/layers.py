"""Building blocks written for tensor parallelism: every layer holds only its rank's share and
names the one collective it needs. At world 1 the collectives are no-ops."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from protocol import ModelConfig

from .host_collectives import HostMemory
from .ops import RopeTables


class WeightSource(Protocol):
    """Reads checkpoint tensors by their Hugging Face names, optionally only a slice."""

    def get(self, name: str, *, dim: int | None = None, part: range | None = None) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of ``tensors``, each counted once (a tied embedding and LM head are one)."""
    seen: dict[int, int] = {id(t): t.numel() * t.element_size() for t in tensors}
    return sum(seen.values())


@dataclass
class PeerRows:
    """A symmetric buffer for sums of up to ``rows`` rows of ``n`` that a kernel takes over the
    GPUs' peer memory, fused with the norm after it (``kernels.fused.rms_norm``): ``ptrs`` each
    rank's buffer address, three slots of rows of a part per rank, every element -0.0 while
    unwritten; ``gens`` this rank's count of sums per row (int64: at some 70 sums a step and a
    thousand steps a second, int32 would wrap within a day)."""

    ptrs: torch.Tensor
    gens: torch.Tensor
    rank: int
    world: int
    rows: int
    n: int
    dtype: torch.dtype
    buffer: torch.Tensor  # keeps the memory

    @staticmethod
    def nbytes(rows: int, n: int, dtype: torch.dtype, world: int) -> int:
        """The bytes of one rank's buffer."""
        return 3 * rows * world * n * dtype.itemsize

    @classmethod
    def over(cls, bases: list[int], buffer: torch.Tensor, rank: int, world: int, rows: int, n: int,
             dtype: torch.dtype) -> PeerRows:
        """Sums over every rank's buffer, ``bases`` their addresses as this process maps them,
        ``buffer`` this rank's (``nbytes`` of uint8), which it clears: every rank must have
        cleared its own before any rank sums."""
        buffer.view(dtype).fill_(-0.0)
        ptrs = torch.tensor(bases, dtype=torch.int64, device=buffer.device)
        gens = torch.zeros(rows, dtype=torch.int64, device=buffer.device)
        return cls(ptrs, gens, rank, world, rows, n, dtype, buffer)

    def takes(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.shape[0] <= self.rows and x.shape[1] == self.n and x.dtype == self.dtype
                and x.is_contiguous() and residual.is_contiguous())


class Collectives:
    """The collectives of one tensor-parallel group: every rank of the process group, or (with
    pipeline stages) the ranks of one stage, ``group``, whose tensor rank 0 is global ``root``."""

    def __init__(self, world: int, group=None, root: int = 0) -> None:
        self.world, self.group, self.root = world, group, root
        self._peer: tuple[torch.Tensor, str] | None = None  # (symmetric buffer, group name)
        self.peers: PeerRows | None = None
        self.host: HostMemory | None = None  # CPU ranks of one host: their shared segment

    def use_host_memory(self, mod, timeout_s: float) -> str:
        """CPU ranks: the collectives go through a segment the group's ranks all map, where they
        share a host (``host_collectives``), else over gloo. A collective. Returns the choice."""
        if self.world == 1:
            return "none needed"
        if os.environ.get("NEURON_HOST_COLLECTIVES", "1") == "0":  # the same on every rank: the daemon's
            return "gloo (NEURON_HOST_COLLECTIVES=0)"
        self.host, why = HostMemory.open(self.world, self.group, self.root, mod, timeout_s)
        return "shared memory" if self.host is not None else f"gloo (no shared memory: {why})"

    def use_peer_memory(self, rows: int, n: int, dtype: torch.dtype, device: torch.device, ops) -> str:
        """Sums of up to ``rows`` rows of ``n`` of ``dtype`` (the steps a CUDA graph runs) go over
        the GPUs' peer memory (NVLink) instead of NCCL, whose latency for a decode step's small
        tensors is several times the transfer: where a norm follows, in the norm's kernel
        (``ops.reduce_add_rms_norm``), elsewhere through torch's one-shot all-reduce. A
        collective: every rank calls it, and all of them choose the same. Returns the choice."""
        if self.world == 1 or device.type != "cuda":
            return "none needed"
        if self.group is not None:  # pipeline stages run eagerly: no graph replays these
            return "NCCL (pipeline stages)"
        why = ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            rank, name = dist.get_rank(), dist.group.WORLD.group_name
            buf = symm_mem.empty(rows * n, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, dist.group.WORLD)
            rows_buf = symm_mem.empty(PeerRows.nbytes(rows, n, dtype, self.world), dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(rows_buf, dist.group.WORLD)
            # buffer_ptrs may be the starts of the pooled allocations that hold the tensors
            offset = rows_buf.data_ptr() - handle.buffer_ptrs[rank]
            if not 0 <= offset <= handle.buffer_size - rows_buf.numel():
                raise RuntimeError(f"the buffer is not where its handle says ({offset})")
            peers = PeerRows.over([b + offset for b in handle.buffer_ptrs], rows_buf, rank, self.world, rows, n, dtype)
            torch.cuda.synchronize(device)
            dist.barrier()  # every rank's buffer is clear before any rank sums
            why = self._probe(buf, name, peers, ops, device)
        except Exception as exc:  # no peer access, no symmetric memory in this build, ...
            why = f"{type(exc).__name__}: {exc}"[:200]
        agreed = torch.tensor([0 if why else 1], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if not agreed.item():
            return f"NCCL (peer memory unavailable: {why or 'on another rank'})"
        self._peer, self.peers = (buf, name), peers
        return "peer memory (one-shot; fused with the norms)"

    def _probe(self, buf: torch.Tensor, name: str, peers: PeerRows, ops, device: torch.device) -> str:
        """Why the peer-memory sums are wrong here ("" when right): each kind, a few times."""
        total = self.world * (self.world + 1) // 2
        mine = float(dist.get_rank() + 1)
        probe = torch.full((4, 8), mine, dtype=buf.dtype, device=device)
        got = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[: probe.numel()].view_as(probe), probe, "sum", name)
        if not bool((got == total).all()):
            return "its one-shot sum was wrong"
        weight = torch.ones(peers.n, dtype=peers.dtype, device=device)
        grid = torch.arange(peers.rows, device=device)[:, None] * 7 + torch.arange(peers.n, device=device)
        for rows in (1, peers.rows, 3, 2, 1, peers.rows):  # small integers: sums exact in any dtype
            part = (grid[:rows] + rows) % 5
            residual = torch.ones(rows, peers.n, dtype=peers.dtype, device=device)
            x = (part * mine).to(peers.dtype)
            _, residual = ops.reduce_add_rms_norm(x, residual, weight, 1e-6, self, peers)
            if not bool((residual == part * total + 1).all()):
                return "its sum in the norm was wrong"
        return ""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (the result may be a new tensor: use the return value)."""
        if self.world > 1:
            peer = self._peer
            if peer is not None and x.is_cuda and x.dtype == peer[0].dtype and x.numel() <= peer[0].numel():
                return torch.ops.symm_mem.one_shot_all_reduce_copy(peer[0][: x.numel()].view_as(x), x.contiguous(),
                                                                  "sum", peer[1])
            if self.host is not None and x.is_floating_point():
                return self.host.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Tensor rank 0's ``x`` on every rank of the group (in place)."""
        if self.world > 1:
            if self.host is not None and self.host.fits(x):
                return self.host.broadcast(x)
            dist.broadcast(x, src=self.root, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim (equal shapes on every rank)."""
        if self.world == 1:
            return x
        if self.host is not None and self.host.fits(x):
            return self.host.all_gather_last(x)
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling of the model's RoPE variant."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    if kind in ("default", ""):
        return inv_freq, 1.0
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, cfg, scaling, factor)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3, yarn)")


def _yarn(inv_freq: torch.Tensor, cfg: ModelConfig, s: dict, factor: float) -> tuple[torch.Tensor, float]:
    dim = cfg.head_dim
    old_len = float(s.get("original_max_position_embeddings", cfg.max_position_embeddings / factor))
    beta_fast, beta_slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))
    attention_factor = float(s.get("attention_factor", 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0))

    def correction(rot: float) -> float:
        return (dim * math.log(old_len / (rot * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(correction(beta_fast)), 0)
    high = min(math.ceil(correction(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv, attention_factor


def rope_tables(cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype,
                freq_divisors: torch.Tensor | None = None) -> RopeTables:
    inv_freq, scale = rope_inv_freq(cfg)
    if freq_divisors is not None:
        inv_freq = inv_freq / freq_divisors.float()
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return RopeTables((emb.cos() * scale).to(device, dtype), (emb.sin() * scale).to(device, dtype))
