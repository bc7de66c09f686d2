"""HTTP limits below the application, in uvicorn's httptools protocol: what no route can enforce
because it happens before (or after) a route runs.

- a request head (request line and headers) over ``max_header_bytes`` gets 431;
- a head not complete within ``header_timeout_s`` of its first byte (or of the connection)
  gets 408, and so does a body not complete within ``body_timeout_s`` of its head;
- a connection over ``max_connections`` gets 503 at once;
- a client that reads nothing for ``write_timeout_s`` while we have data for it is dropped: its
  stream's sequence is aborted (the route sees the disconnect) and its slot freed;
- an idle keep-alive connection is closed after ``keep_alive_timeout_s`` (uvicorn's own timer).
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from neuron.config import HttpConfig

log = logging.getLogger("neuron.server")


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def refusal(status: int, message: str) -> bytes:
    """A whole HTTP response in the OpenAI error envelope, that closes the connection."""
    code = {408: "request_timeout", 431: "headers_too_large", 503: "too_many_connections"}.get(status, "invalid_request")
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code,
                                 "param": None}}).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class LimitedHttp(HttpToolsProtocol):
    limits: HttpConfig = HttpConfig()

    # ------------------------------------------------------------------------- connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._head_open = True
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"the server has {self.limits.max_connections} connections open; try again later")
            return
        self._arm_read(self.limits.header_timeout_s, "request head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read()
        self._disarm_write()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self.parser is None:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _Refused):
                self._refuse(exc.__context__.status, exc.__context__.message)
            else:
                self._bad_request()
            return
        except httptools.HttpParserError:
            self._bad_request()
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._head_open:  # a head still arriving: what it has taken so far counts
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"the request head is over {self.limits.max_header_bytes} bytes")

    # ------------------------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._head_open = True
        if self._read_timer is None:
            self._arm_read(self.limits.header_timeout_s, "request head")

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._disarm_read()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.more_body:
            self._arm_read(self.limits.body_timeout_s, "request body")

    def on_message_complete(self) -> None:
        self._disarm_read()
        super().on_message_complete()

    # ------------------------------------------------------------------------- writing
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_timeout)

    def resume_writing(self) -> None:
        self._disarm_write()
        super().resume_writing()

    def _write_timeout(self) -> None:
        self._write_timer = None
        log.warning("%s read nothing for %.0fs; dropping the connection", _peer(self.client),
                    self.limits.write_timeout_s)
        self.transport.abort()

    # ------------------------------------------------------------------------- helpers
    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.limits.max_header_bytes:
            raise _Refused(431, f"the request head is over {self.limits.max_header_bytes} bytes")

    def _arm_read(self, seconds: float, what: str) -> None:
        self._disarm_read()
        self._read_timer = self.loop.call_later(seconds, self._read_timeout, seconds, what)

    def _disarm_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _disarm_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _read_timeout(self, seconds: float, what: str) -> None:
        self._read_timer = None
        started = self.cycle is not None and self.cycle.response_started and not self._head_open
        if started:  # the route answered without reading the whole body: just close
            self.transport.close()
            return
        log.warning("%s sent no complete %s within %.0fs; closing", _peer(self.client), what, seconds)
        self._refuse(408, f"the {what} did not arrive within {seconds:g}s")

    def _refuse(self, status: int, message: str) -> None:
        self._head_open = False
        self._disarm_read()
        if not self.transport.is_closing():
            self.transport.write(refusal(status, message))
            self.transport.close()

    def _bad_request(self) -> None:
        self.logger.warning("Invalid HTTP request received.")
        self._refuse(400, "invalid HTTP request")


def _peer(client: tuple[str, int] | None) -> str:
    return "%s:%d" % client if client else "a client"


def limited_protocol(limits: HttpConfig) -> type[LimitedHttp]:
    """The protocol class uvicorn builds each connection with, under ``limits``."""
    return type("LimitedHttp", (LimitedHttp,), {"limits": limits})
