"""A sequence as the Engine tracks it: made from the ``EngineRequest`` the API side handed over,
with the scheduler's, the cache's and the drafter's state of it. What it draws goes out through
its ``sink`` (``protocol/engine_client.py``); its text, stop strings and events are the API
side's."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from protocol import Sampling
from protocol.api_core import EngineRequest, Image
from protocol.engine_client import OutputSink, TokenConstraint

from .blocks import chain_of

_ids = itertools.count(1)


@dataclass(eq=False)  # a request is itself: comparing every field would cost each list lookup
class GenRequest:
    prompt: list[int]
    sampling: Sampling
    max_tokens: int
    stop_token_ids: frozenset[int]
    sink: OutputSink | None = None  # an Engine's sequences have one; None only where a scheduler runs alone
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output: list[int] = field(default_factory=list)
    slot: int = -1  # the rank-side row of the running sequence (-1: not running)
    states: list[int] = field(default_factory=list)  # its state slot, for a model with recurrent layers
    restore: Any = None  # the state snapshot (state_cache.Snapshot) its first step starts from, pinned
    snapshot_floor: int = 0  # where its state started (snapshots are taken past it)
    passing: bytes = b""  # the snapshot it passes when it keeps a deeper one: its own last, by name
    passing_start: bool = False  # ... or the one it started from (``StateCache.passed``)
    blocks: list[int] = field(default_factory=list)  # its KV-cache block table
    sent_blocks: int = 0  # entries of ``blocks`` the ranks have been sent
    computed: int = 0  # tokens in the KV cache, or on their way in a step in flight
    pending: int = 0  # tokens drawn in steps still in flight (not in ``output`` yet)
    order: int = 0  # admission order: the newest running request is preempted first
    preempted: int = 0
    run: int = 0  # bumped at each preemption: replies of an earlier run touch nothing
    confirmed: int = 0  # positions whose K/V a finished step has computed
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of its leading full blocks
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    host_tokens: int = 0  # ... of them, in the host tier (copied back into the rank's cache)
    disk_tokens: int = 0  # ... of those, read back from the disk tier first
    restoring: list = field(default_factory=list)  # (host slot, block, hash) of its blocks to restore first
    host_run: int = -1  # the run whose blocks came (in part) from the host tier
    state_tiered: bool = False  # its state slot starts with a snapshot restored from the host tier
    cache_salt: bytes = b""  # only requests with the same salt share cached prefixes
    principal: str = ""  # whose request (an API key's name): the unit of fair share
    weight: float = 1.0  # its principal's share of admitted work, against the others'
    max_running: int = 0  # its principal's running requests at most (0: no cap)
    max_waiting: int = 0  # its principal's waiting requests at most (0: no cap)
    priority: int = 0  # among its principal's waiting requests, lower goes first (vLLM's)
    finished: bool = False
    cancelled: bool = False
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    admitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    constraint: TokenConstraint | None = None
    spec: Any = None  # its drafting (speculative.Speculation), where the model drafts and its sampling allows
    images: list[Image] = field(default_factory=list)
    end_reason: str = "abort"  # what ends it when cancelled: "stop" when its API side found a stop string
    keyed_prompt: list[int] = field(init=False)
    chain_key: bytes = b""  # the key of ``chain_memo``
    chain_memo: list[bytes] = field(default_factory=list)  # chain hashes of its leading full blocks, so far

    @classmethod
    def of(cls, r: EngineRequest, sink: OutputSink, constraint: TokenConstraint | None) -> GenRequest:
        return cls(r.prompt, r.sampling, r.max_tokens, frozenset(r.stop_token_ids), sink, r.request_id,
                   cache_salt=r.cache_salt, principal=r.principal, weight=r.weight, max_running=r.max_running,
                   max_waiting=r.max_waiting, priority=r.priority, constraint=constraint, images=list(r.images))

    def __post_init__(self) -> None:
        self.keyed_prompt = self.prompt
        if self.images:  # the prefix cache tells images apart by content: their pad tokens hash as it
            self.keyed_prompt = list(self.prompt)
            for image in self.images:  # 40 bits of the hash a token, in turn (a block holds them all)
                parts = [int.from_bytes(image.key[j: j + 5], "little") << 16 for j in (0, 5, 10)]
                self.keyed_prompt[image.offset: image.offset + image.tokens] = \
                    [-(parts[i % 3] + i % 65536 + 1) for i in range(image.tokens)]

    def keyed(self) -> list[int]:
        """Its tokens as the prefix cache hashes them (``prompt + output`` but for images)."""
        return self.keyed_prompt + self.output

    def chain(self, blocks: int, key: bytes, bs: int) -> list[bytes]:
        """The chain hashes of its first ``blocks`` full blocks (``keyed()``) under ``key``, each
        computed once: a request waiting at the head of the queue is matched again every step."""
        if key != self.chain_key:
            self.chain_key, self.chain_memo = key, []
        if len(self.chain_memo) < blocks:
            chain_of(self.keyed(), blocks, bs, key, self.chain_memo)
        return self.chain_memo[:blocks]

    @property
    def rest(self) -> int:
        """Known tokens not yet computed: a prompt's rest, or (recomputed) prompt and output."""
        return len(self.prompt) + len(self.output) - self.computed

    def abort(self, reason: str = "abort") -> None:
        """The client went away (or, across processes, a stop string ended it): the scheduler
        drops the sequence at the next step."""
        self.cancelled = True
        self.end_reason = reason
