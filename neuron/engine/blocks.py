"""The KV-cache block allocator. Plain Python on the leader: the ranks hold the blocks, the leader
alone decides who owns which.

A block holds ``block_size`` positions of one sequence's K/V in every layer. A sequence owns an
ordered list of blocks (its block table). Blocks carry reference counts so that a full block
can later be shared by sequences with the same prefix; a block returns to the free list only
when its count drops to zero.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(Exception):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV cache needs at least one block of at least one token")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.refs = [0] * num_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free_count(self) -> int:
        return len(self.free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise OutOfBlocks(f"{n} blocks asked for, {len(self.free)} free")
        blocks = [self.free.popleft() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def grow(self, table: list[int], tokens: int) -> list[int]:
        """Extend ``table`` to hold ``tokens`` positions; returns the blocks added."""
        need = self.blocks_for(tokens) - len(table)
        if need <= 0:
            return []
        added = self.allocate(need)
        table.extend(added)
        return added

    def release(self, table: list[int]) -> None:
        """Drop one reference to each block of ``table`` (and empty it)."""
        for b in table:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than allocated")
        table.clear()
