"""Stored responses of ``/v1/responses``, for ``previous_response_id`` and ``GET
/v1/responses/{id}``: in memory, the most recently used ``[server] stored_responses`` of them."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

import msgspec


class ResponseStore:
    """The conversations of recent responses, for ``previous_response_id``: an LRU of at most
    ``size`` entries, in memory."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        if self.size <= 0:
            return
        self.entries[response_id] = (messages, response)
        self.entries.move_to_end(response_id)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        found = self.entries.get(response_id)
        if found is not None:
            self.entries.move_to_end(response_id)
        return found

    async def fetch(self, response_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        return self.get(response_id)


class CoreResponses:
    """The store of an API process (``[server] api_processes``): the engine core keeps one
    ``ResponseStore`` for all of them, so a response stored through one process is found
    through any. ``put`` goes out at once (before the response's last frames), ``fetch`` asks."""

    def __init__(self, link) -> None:
        self.link = link  # server.core_link.CoreLink
        self._sent: set[asyncio.Task] = set()

    def put(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        body = msgspec.json.encode({"id": response_id, "messages": messages, "response": response})
        task = asyncio.ensure_future(self.link.call("response_put", body, timeout=30.0))
        self._sent.add(task)
        task.add_done_callback(lambda t: self._sent.discard(t) or t.cancelled() or t.exception())

    async def fetch(self, response_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        found = msgspec.json.decode(await self.link.call("response_get", msgspec.json.encode(response_id),
                                                         timeout=30.0))
        return None if found is None else (found[0], found[1])
