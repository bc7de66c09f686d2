"""The collectives of CPU ranks on one host through memory they all map, instead of gloo: gloo's
TCP round trips cost about a millisecond for a decode step's few kilobytes (more when the ranks
outnumber the cores), and a step makes two of them per layer. Each rank writes its part into its
own slot of the segment, meets the others (``arrive_and_wait`` in the CPU kernels: a release of
its round, acquires of theirs), then reads every part. Two sets of slots, used in turn, keep a
rank that runs ahead from writing over parts a slower one is still reading. Every rank sums the
parts in rank order, so all of them hold the same bits."""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid

import torch
import torch.distributed as dist

SLOT_BYTES = 1 << 21  # per rank and set: a larger all-reduce goes in pieces, a larger gather over gloo
HEADER = 4096  # one counter per rank, 64 bytes apart
NAME_BYTES = 256


class HostMemory:
    """One tensor-parallel group's segment, mapped by each of its ranks (``open`` makes it)."""

    def __init__(self, mm: mmap.mmap, rank: int, world: int, mod, timeout_ms: int) -> None:
        self.mm, self.rank, self.world, self.mod, self.timeout_ms = mm, rank, world, mod, timeout_ms
        raw = torch.frombuffer(mm, dtype=torch.uint8)
        self.counters = raw[:HEADER]
        self.slots = raw[HEADER:].view(2, world, SLOT_BYTES)
        self.round = 0

    @classmethod
    def open(cls, world: int, group, root: int, mod, timeout_s: float) -> tuple[HostMemory | None, str]:
        """The group's segment, or None and why not. A collective: every rank of ``group`` calls
        it, tensor rank 0 (global ``root``) creates the segment, and all of them choose the same."""
        rank = dist.get_rank(group)
        mm, why, made = None, "", False
        name = torch.zeros(NAME_BYTES, dtype=torch.uint8)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, f"neuron-tp-{uuid.uuid4().hex}")
        size = HEADER + 2 * world * SLOT_BYTES
        if rank == 0:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                made = True
                try:
                    os.posix_fallocate(fd, 0, size)  # a full /dev/shm refuses now, not with a SIGBUS later
                    mm = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
                encoded = f"{path}|{host_id()}".encode()
                name[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
            except OSError as exc:
                why = f"cannot make {path}: {exc}"
        try:
            dist.broadcast(name, src=root, group=group)
            if rank != 0:
                path, _, host = bytes(name[name != 0].tolist()).decode().partition("|")
                try:
                    if host != host_id():
                        raise ValueError("rank 0 is on another host (or network namespace)")
                    fd = os.open(path, os.O_RDWR)
                    try:
                        mm = mmap.mmap(fd, size) if os.fstat(fd).st_size == size else None
                    finally:
                        os.close(fd)
                    why = "" if mm is not None else f"{path} is not the segment rank 0 made"
                except (OSError, ValueError) as exc:
                    why = f"cannot open the segment: {exc}" if path else "rank 0 made no segment"
            if mod is None:
                why = why or "the CPU kernels are not built"
            shared = cls(mm, rank, world, mod, int(timeout_s * 1000)) if _agree(not why, group) else None
            if shared is not None and not _agree(shared.probe(), group):
                shared, why = None, why or "its probe sum was wrong"
        finally:
            if made:  # every rank has it mapped, has given up, or failed: nothing is left behind
                os.unlink(path)
        if shared is None:
            return None, why or "another rank could not map it"  # the mapping goes with its last view
        return shared, ""

    def probe(self) -> bool:
        """Whether the ranks really share the segment: a sum of known parts, twice over."""
        total = self.world * (self.world + 1) // 2
        for _ in range(2):
            x = torch.full((3, 5), float(self.rank + 1))
            if not bool((self.all_reduce(x) == total).all()):
                return False
        return True

    def _meet(self) -> int:
        self.round += 1
        self.mod.arrive_and_wait(self.counters.data_ptr(), self.rank, self.world, self.round, self.timeout_ms)
        return self.round & 1

    def _parts(self, which: int, dtype: torch.dtype, n: int) -> list[torch.Tensor]:
        return [self.slots[which, r, : n * dtype.itemsize].view(dtype) for r in range(self.world)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, into ``x``: float32 in pieces of a slot, other float dtypes summed
        in float32."""
        flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
        work = flat if flat.dtype == torch.float32 else flat.float()
        step = SLOT_BYTES // 4
        for lo in range(0, work.numel(), step):
            piece = work[lo: lo + step]
            which = (self.round + 1) & 1
            self._parts(which, torch.float32, piece.numel())[self.rank].copy_(piece)
            parts = self._parts(self._meet(), torch.float32, piece.numel())
            torch.add(parts[0], parts[1], out=piece)
            for part in parts[2:]:
                piece.add_(part)
        if work is not flat:
            flat.copy_(work)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the segment in one round (a gather or a broadcast)."""
        return x.numel() * x.element_size() <= SLOT_BYTES

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        which = (self.round + 1) & 1
        self._parts(which, x.dtype, x.numel())[self.rank].copy_(x.view(-1))
        parts = self._parts(self._meet(), x.dtype, x.numel())
        return torch.cat([p.view_as(x) for p in parts], dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Tensor rank 0's ``x`` on every rank, in place."""
        which = (self.round + 1) & 1
        if self.rank == 0:
            self._parts(which, x.dtype, x.numel())[0].copy_(x.contiguous().view(-1))
        mine = self._parts(self._meet(), x.dtype, x.numel())[0]
        if self.rank != 0:
            x.copy_(mine.view_as(x))
        return x


def host_id() -> str:
    """This host, as the segment's users must share it: the boot, and the network namespace
    (ranks in other namespaces stand for other hosts, as in the multihost tests)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return "unknown"


def _agree(ok: bool, group) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
