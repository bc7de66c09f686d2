"""The masks of a step's ``mask_later`` rows (``protocol.StepMasks``): put by the rank's socket
loop as they come, taken by the device thread when the step is about to sample. The leader
computes them while the step's forward runs; a step whose masks do not come within MASKS_WAIT_S
fails (the leader lost them: its engine answers the step's requests with the error)."""

from __future__ import annotations

import threading
import time

import protocol as p

MASKS_WAIT_S = 20.0
KEEP = 64  # frames for steps not taken yet: a step rejected before sampling leaves its own behind


class LateMasks:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._frames: dict[int, dict[int, bytes]] = {}

    def put(self, msg: p.StepMasks) -> None:
        if len(msg.which) != len(msg.slots) or not all(0 <= w < len(msg.masks) for w in msg.which):
            raise ValueError(f"step {msg.step_id}: a step_masks frame whose rows name no mask")
        with self._cond:
            self._frames.setdefault(msg.step_id, {}).update((s, msg.masks[w]) for s, w in zip(msg.slots, msg.which))
            while len(self._frames) > KEEP:
                del self._frames[min(self._frames)]
            self._cond.notify_all()

    def take(self, step_id: int, slots: list[int], timeout: float = MASKS_WAIT_S) -> list[bytes | None]:
        """The masks of ``slots`` in step ``step_id`` (None: unconstrained), once all are in;
        TimeoutError if they are not within ``timeout``. Older steps' leftovers are dropped."""
        with self._cond:
            def complete() -> bool:
                got = self._frames.get(step_id, {})
                return all(slot in got for slot in slots)
            if not self._cond.wait_for(complete, timeout):
                missing = [s for s in slots if s not in self._frames.get(step_id, {})]
                raise TimeoutError(f"step {step_id}: no mask for slots {missing} within {timeout:.0f}s")
            got = self._frames.pop(step_id)
            for old in [k for k in self._frames if k < step_id]:
                del self._frames[old]
        return [got[slot] or None for slot in slots]


def row_masks(step_id: int, sampled: list[p.StepSeq], late: LateMasks | None, vocab: int
              ) -> tuple[list[bytes | None], float]:
    """Each sampled row's mask, its own or the one that came later (waited for here), and the ms
    waited; ValueError when the later ones cannot be had or do not fit the vocabulary."""
    later = [s.slot for s in sampled if s.mask_later]
    if not later:
        return [s.allowed for s in sampled], 0.0
    if late is None:
        raise ValueError("mask_later rows need a rank that takes StepMasks")
    t0 = time.perf_counter()
    try:
        came = dict(zip(later, late.take(step_id, later)))
    except TimeoutError as exc:
        raise ValueError(str(exc)) from None
    size = 4 * ((vocab + 31) // 32)
    wrong = [slot for slot, mask in came.items() if mask is not None and len(mask) != size]
    if wrong:
        raise ValueError(f"step {step_id}: the masks of slots {wrong} do not match the vocabulary")
    return [came[s.slot] if s.mask_later else s.allowed for s in sampled], (time.perf_counter() - t0) * 1e3
