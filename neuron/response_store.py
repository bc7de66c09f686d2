"""Stored responses of ``/v1/responses``, for ``previous_response_id`` and ``GET
/v1/responses/{id}``: in memory, the most recently used ``[server] stored_responses`` of them."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


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
