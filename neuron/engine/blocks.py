"""The KV-cache block allocator, with automatic prefix caching. Plain Python on the leader: the
ranks hold the blocks, the leader alone decides who owns which.

A block holds ``block_size`` positions of one sequence's K/V in every layer. A sequence owns an
ordered list of blocks (its block table). A full block whose K/V is computed is registered under
a hash chained over everything before it (the previous block's hash, its own tokens, and a key
naming the model and anything else that changes K/V), so that a later sequence with the same
prefix takes the block instead of computing it again. Blocks carry reference counts: a shared
block is freed only when its last user lets go, and a freed block that holds a cached prefix stays
findable, least recently used first to go, until its memory is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from functools import lru_cache
from typing import Callable


class OutOfBlocks(Exception):
    pass


def chain_hash(parent: bytes, tokens: list[int] | tuple[int, ...], key: bytes) -> bytes:
    """The identity of a full block: its tokens, all tokens before it (through ``parent``), and
    ``key``. 128 bits of BLAKE2b: a collision would silently serve wrong K/V. Tokens are hashed
    as 64-bit integers: a 4000-token prompt is matched in well under a millisecond."""
    h = hashlib.blake2b(parent, digest_size=16, key=_mac_key(key))
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_of(tokens: list[int], blocks: int, bs: int, key: bytes, known: list[bytes]) -> list[bytes]:
    """``known`` (the chain hashes of the first full blocks of ``tokens``) extended in place to
    ``blocks`` of them."""
    for i in range(len(known), blocks):
        known.append(chain_hash(known[-1] if known else b"", tokens[i * bs: (i + 1) * bs], key))
    return known


@lru_cache(maxsize=256)
def _mac_key(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=32).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, cache_key: bytes | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV cache needs at least one block of at least one token")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.cache_key = cache_key  # None: prefix caching off
        # A GPU cache can hold millions of blocks: untouched ones are a counter, not a list.
        self._fresh = 0
        self._recycled: deque[int] = deque()
        self.refs: dict[int, int] = {}
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused: LRU first
        self.queries = 0  # prompt tokens looked up in the cache
        self.hits = 0  # ... and found
        # Told each cached block evicted, and its hash (before the block is handed out again).
        self.on_evict: list[Callable[[int, bytes], None]] = []
        self.on_register: list[Callable[[int, bytes], None]] = []  # told each block cached, and its hash

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free_count(self) -> int:
        """Blocks that can be handed out: never used, recycled, or cached but unused."""
        return self.num_blocks - len(self.refs)

    @property
    def used(self) -> int:
        return len(self.refs)

    @property
    def cached(self) -> int:
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.free_count

    def allocate(self, n: int) -> list[int]:
        if n > self.free_count:
            raise OutOfBlocks(f"{n} blocks asked for, {self.free_count} free")
        blocks = []
        for _ in range(n):
            if self._fresh < self.num_blocks:
                b = self._fresh
                self._fresh += 1
            elif self._recycled:
                b = self._recycled.popleft()
            else:  # the least recently used cached block gives up its prefix
                b, _ = self._evictable.popitem(last=False)
                h = self._hash_of.pop(b)
                del self._by_hash[h]
                for tell in self.on_evict:
                    tell(b, h)
            blocks.append(b)
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
        """Drop one reference to each block of ``table`` (and empty it). Cached blocks join the
        eviction order last block first: a prefix's tail is evicted before its head, which the
        tail cannot be matched without."""
        cached = []
        for b in table:
            left = self.refs.get(b, 0) - 1
            if left < 0:
                raise RuntimeError(f"block {b} released more often than allocated")
            if left:
                self.refs[b] = left
                continue
            del self.refs[b]
            if b in self._hash_of:
                cached.append(b)
            else:
                self._recycled.append(b)
        for b in reversed(cached):
            self._evictable[b] = None
        table.clear()

    # ----------------------------------------------------------------------------- prefixes
    def key(self, salt: bytes = b"") -> bytes:
        """The hash key of a request's blocks: the model's key and the request's cache salt."""
        assert self.cache_key is not None
        return self.cache_key + b"|" + salt if salt else self.cache_key

    def match(self, tokens: list[int], limit: int, salt: bytes = b"",
              chain: list[bytes] | None = None) -> tuple[list[int], list[bytes]]:
        """The cached blocks (and their hashes) that hold the longest prefix of ``tokens`` made of
        full blocks, at most ``limit`` tokens long (``chain``: the hashes of those full blocks,
        if known). Counted as a query; not yet taken."""
        if self.cache_key is None:
            return [], []
        key = self.key(salt)
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = b""
        for i in range(min(limit, len(tokens)) // bs):
            h = chain[i] if chain is not None else chain_hash(parent, tokens[i * bs: (i + 1) * bs], key)
            b = self._by_hash.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        self.queries += limit
        self.hits += len(blocks) * bs
        return blocks, hashes

    def take(self, blocks: list[int]) -> None:
        """Hold cached blocks found by ``match``."""
        for b in blocks:
            if b in self.refs:
                self.refs[b] += 1
            else:
                del self._evictable[b]
                self.refs[b] = 1

    def revived(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are cached but unused (taking them uses up free blocks)."""
        return sum(1 for b in blocks if b not in self.refs)

    def register(self, block: int, h: bytes) -> None:
        """``block`` (held) now holds the full block whose chain hash is ``h``."""
        if self.cache_key is None or block in self._hash_of:
            return
        if h in self._by_hash:  # computed twice (two sequences raced to the same prefix): keep one
            return
        self._by_hash[h] = block
        self._hash_of[block] = h
        for tell in self.on_register:
            tell(block, h)

    def holds(self, block: int, h: bytes) -> bool:
        """Whether ``block`` is cached under ``h`` (its K/V stays as it is while it is)."""
        return self._by_hash.get(h) == block
