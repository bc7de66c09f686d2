"""The waiting requests of a model, in fair order between principals (API keys): one queue per
principal, ordered by ``priority`` then arrival, and between the queues start-time fair queuing.
Each principal has a pass, its admitted work (prompt plus token budget) divided by its weight; the
next request comes from the principal with the lowest pass, among those under their cap of running
requests. A principal that starts waiting again begins at the current virtual time (the pass of
the last admission), so idle time is not banked. Preempted requests had started: they go first,
except one that gave its slot to a principal with nothing running (``slot_victim``): that one goes
back to the head of its own principal's queue, its admission already paid."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from typing import Iterator

from .request import GenRequest


PASSES_KEPT = 1024  # principals' passes kept before the idle ones are forgotten


def cost(req: GenRequest) -> int:
    """The work a request may take: its prompt and its token budget."""
    return len(req.prompt) + req.max_tokens


class FairQueue:
    def __init__(self) -> None:
        self.front: deque[GenRequest] = deque()
        self.queues: dict[str, list[tuple[int, int, GenRequest]]] = {}
        self.passes: dict[str, float] = {}
        self.clock = 0.0
        self._arrivals = itertools.count()
        self._size = 0
        self.paid: set[int] = set()  # requests that gave their slot up: their admission was paid

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[GenRequest]:
        yield from list(self.front)
        for queue in list(self.queues.values()):
            yield from [entry[2] for entry in queue]

    def __contains__(self, req: object) -> bool:
        return any(r is req for r in self)

    def waiting_of(self, principal: str) -> int:
        return len(self.queues.get(principal, ()))

    def append(self, req: GenRequest) -> None:
        queue = self.queues.setdefault(req.principal, [])
        if not queue:
            self.passes[req.principal] = max(self.passes.get(req.principal, 0.0), self.clock)
            if len(self.passes) > PASSES_KEPT:
                self._forget()
        heapq.heappush(queue, (req.priority, next(self._arrivals), req))
        self._size += 1

    def extend(self, reqs: list[GenRequest]) -> None:
        for req in reqs:
            self.append(req)

    def requeue(self, req: GenRequest) -> None:
        """A running request gave its slot up for another principal: it is its principal's next,
        already paid for (it pays nothing when it starts again)."""
        self.passes.setdefault(req.principal, self.clock)
        heapq.heappush(self.queues.setdefault(req.principal, []), (float("-inf"), next(self._arrivals), req))
        self.paid.add(id(req))
        self._size += 1

    def appendleft(self, req: GenRequest) -> None:
        self.front.appendleft(req)
        self._size += 1

    def remove(self, req: GenRequest) -> None:
        if any(r is req for r in self.front):
            self.front.remove(req)
        else:
            queue = self.queues[req.principal]
            queue[:] = [e for e in queue if e[2] is not req]
            heapq.heapify(queue)
            if not queue:
                del self.queues[req.principal]
        self.paid.discard(id(req))
        self._size -= 1

    def next(self, running: Counter, idle: bool = False) -> GenRequest | None:
        """The request to admit next, or None: every waiting principal is at its cap. ``idle``:
        only from a principal with nothing running (one that may take a slot from another)."""
        if self.front:
            return None if idle else self.front[0]
        best: tuple[tuple[float, int], str] | None = None
        for name, queue in self.queues.items():
            head = queue[0][2]
            if (head.max_running and running[name] >= head.max_running) or (idle and running[name]):
                continue
            key = (self.passes[name], queue[0][1])
            if best is None or key < best[0]:
                best = (key, name)
        return None if best is None else self.queues[best[1]][0][2]

    def _forget(self) -> None:
        """Drop the passes of principals that wait for nothing (a gateway's header can name any
        number of them): they start again at the clock, forgiven at most what their last
        admissions put them ahead of it."""
        for name in [n for n in self.passes if n not in self.queues]:
            del self.passes[name]

    def pop(self, req: GenRequest) -> None:
        """``req``, which ``next`` gave, is admitted: its principal pays for it."""
        self._size -= 1
        if self.front and self.front[0] is req:
            self.front.popleft()
            return
        name = req.principal
        queue = self.queues[name]
        heapq.heappop(queue)
        if id(req) in self.paid:
            self.paid.discard(id(req))
        else:
            self.clock = self.passes[name]
            self.passes[name] += cost(req) / req.weight
        if not queue:
            del self.queues[name]


def slot_victim(running: list[GenRequest], waiting: GenRequest) -> GenRequest | None:
    """Every slot is taken and ``waiting`` (the next in fair order) has no request running: the
    newest request of the principal running the most, if that is at least two, gives up its slot
    (``Scheduler.admit``). A principal keeps one running request; nobody waits for a whole stream."""
    counts = Counter(r.principal for r in running)
    if counts[waiting.principal] or not counts:
        return None
    most = max(counts.values())
    if most < 2:
        return None
    return max((r for r in running if counts[r.principal] == most), key=lambda r: r.order)
