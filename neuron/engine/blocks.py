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
        # A GPU cache can hold millions of blocks: untouched ones are a counter, not a list.
        self._fresh = 0
        self._recycled: deque[int] = deque()
        self.refs: dict[int, int] = {}

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free_count(self) -> int:
        return self.num_blocks - len(self.refs)

    @property
    def used(self) -> int:
        return len(self.refs)

    def can_allocate(self, n: int) -> bool:
        return n <= self.free_count

    def allocate(self, n: int) -> list[int]:
        if n > self.free_count:
            raise OutOfBlocks(f"{n} blocks asked for, {self.free_count} free")
        blocks = []
        for _ in range(n):
            if self._recycled:
                blocks.append(self._recycled.popleft())
            else:
                blocks.append(self._fresh)
                self._fresh += 1
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
            left = self.refs.get(b, 0) - 1
            if left < 0:
                raise RuntimeError(f"block {b} released more often than allocated")
            if left == 0:
                del self.refs[b]
                self._recycled.append(b)
            else:
                self.refs[b] = left
        table.clear()
