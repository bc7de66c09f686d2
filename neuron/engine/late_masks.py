"""Token masks that follow their step (``StepSeq.mask_later``), so that constrained sequences
overlap their steps as free ones do.

A constraint's mask for a sequence's next token depends on the token before, which is still on
the device when the next step is planned. Without this, such a sequence sat out every other
step's planning, and its step waited for the round trip. Now the step goes out with the row's
mask to come; once the token before is known (the previous step's reply, or in an API process's
case the mask it computed from it), the mask is sent after the step, to the sampling rank, which
waits for it only when it samples, after the forward.

A row whose sequence ended meanwhile gets b"" (unconstrained: its token is dropped), so a rank
never waits for a mask that will not come."""

from __future__ import annotations

from typing import Any

from .request import GenRequest

NOT_YET: Any = object()


def mask_now(req: GenRequest, index: int) -> Any:
    """The mask of ``req``'s output token ``index`` (None: any token), or NOT_YET. A constraint
    that runs in an API process has the masks it was sent (``mask_at``); one that runs here can
    give only the next token's."""
    c = req.constraint
    at = getattr(c, "mask_at", None)
    if at is not None:
        return at(index)
    return c.allowed() if index == len(req.output) else NOT_YET


class LateMasks:
    def __init__(self) -> None:
        self.due: dict[GenRequest, list[tuple[int, int, int]]] = {}  # (output index, step id, slot)

    def fields(self, req: GenRequest, sample: bool, step_id: int) -> dict[str, Any]:
        """The StepSeq fields of a planned row (its token counted in ``req.pending``): its mask
        now, or mask_later."""
        if not sample or req.constraint is None:
            return {}
        index = len(req.output) + req.pending - 1
        mask = mask_now(req, index)
        if mask is NOT_YET:
            self.due.setdefault(req, []).append((index, step_id, req.slot))
            return {"mask_later": True}
        return {"allowed": mask}

    def send(self, group: Any, reqs: list[GenRequest] | None = None) -> None:
        """Every due mask that is known now (of ``reqs`` only, if given), to the ranks."""
        out: dict[int, tuple[list[int], list[bytes]]] = {}
        for req in list(self.due) if reqs is None else [r for r in reqs if r in self.due]:
            waiting = []
            for index, step_id, slot in self.due.pop(req):
                mask = b"" if req.finished or req.cancelled else mask_now(req, index)
                if mask is NOT_YET:
                    waiting.append((index, step_id, slot))
                    continue
                slots, masks = out.setdefault(step_id, ([], []))
                slots.append(slot)
                masks.append(mask or b"")
            if waiting:
                self.due[req] = waiting
        if group is not None:
            for step_id, (slots, masks) in out.items():
                group.send_masks(step_id, slots, masks)

    def clear(self) -> None:
        self.due.clear()
