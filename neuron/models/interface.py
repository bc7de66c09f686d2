"""What the runner and the rank know of a model: the interface every family's model has, and the
state each of its layers keeps per sequence. No family is named here.

Each layer declares its per-sequence state (``state_specs``):

- ``KvState``: paged K/V in blocks of the KV cache (attention). Attention layers call the step's
  ``AttentionFn`` with their index among the layers that keep K/V.
- ``RecurrentState``: a fixed-size state per sequence (a linear-attention or SSM layer), one or
  more tensors of fixed shapes in a state slot the leader assigns. Recurrent layers read the
  step's ``state_spans`` (each sequence's rows and state slot, in order, and the snapshots of the
  state to take) and their tensors in ``states.layer(i)`` (``i``: the index among the layers that
  keep such state), both on the ``AttentionFn`` the step passes; a slot is cleared on its
  sequence's first step, or copied from a snapshot (the prefix cache).
- ``None``: nothing (an MLP-only layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from protocol import ModelConfig

from .layers import Collectives
from .ops import Rotary, TorchOps


@dataclass(frozen=True)
class KvState:
    n_kv: int  # this rank's KV heads
    head_dim: int


@dataclass(frozen=True)
class RecurrentState:
    shapes: tuple[tuple[int, ...], ...]  # the state's tensors of one sequence (this rank's share)
    # Of each tensor; None (or not given): the configured state dtype (float32 by default), for a
    # state that accumulates, where a coarser dtype trades accuracy for memory.
    dtypes: tuple[torch.dtype | None, ...] = ()

    def dtype(self, i: int, configured: torch.dtype = torch.float32) -> torch.dtype:
        given = self.dtypes[i] if i < len(self.dtypes) else None
        return given if given is not None else configured


LayerState = KvState | RecurrentState | None


@dataclass(frozen=True)
class AttentionShape:
    """What an attention implementation must know of one rank's heads (equal in every layer)."""

    n_q: int
    n_kv: int
    head_dim: int
    scale: float
    kv_of_q: tuple[int, ...]  # for each local query head, its local KV head
    gqa_repeat: int  # query heads per KV head when kv_of_q is the uniform grouping, else 0


class AttentionFn(Protocol):
    """Attention of one layer over the step's tokens: position q and k (``rotary`` at
    ``positions``), store k/v in the KV cache, attend each token's query over its sequence's keys
    (causally). ``qkv`` [T, n_q + 2 n_kv, hd] (the heads of q, k, v in a row) -> [T, n_q * hd].
    ``layer``: the layer's index among those that keep K/V."""

    def __call__(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor: ...


class Model(Protocol):
    """One rank's shard of a model. It holds weights only: the caches and how a step runs belong
    to the rank's runner."""

    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    comm: Collectives
    ops: TorchOps  # the runner swaps in fused kernels
    capturable: bool  # whether a step can be captured in a CUDA graph
    # Whether its recurrent layers take the state snapshots a step asks for (``StateSpans.snapshots``,
    # in the middle of a sequence's tokens): without them a model with state has no prefix cache.
    state_snapshots: bool
    attention_shape: AttentionShape

    def state_specs(self) -> list[LayerState]:
        """The per-sequence state of each layer, in order."""
        ...

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: AttentionFn,
                rows: torch.Tensor | None) -> torch.Tensor:
        """Full-vocabulary float32 logits of token rows ``rows`` (all when None) of the step's
        flattened tokens, identical on every rank."""
        ...

    def weight_bytes(self) -> int: ...

    def linears(self) -> tuple[list, list[str]]:
        """Every projection (a concatenated one's parts one by one), and the dtypes of sparse
        experts held as stacked dense tensors (one per such layer)."""
        ...

    def tunable(self) -> list[tuple[object, str]]:
        """(owner, attribute) of every dense projection the runner may swap for a tuned one."""
        ...
