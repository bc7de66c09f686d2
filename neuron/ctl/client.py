"""A running daemon seen from the command line: its URL and keys, and one way to call it that
turns every failure into a one-line message."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:13131"


class CtlError(Exception):
    """Printed as ``neuron: <message>`` and exit status 1."""


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("NEURON_URL", DEFAULT_URL),
                   help=f"the daemon (default: $NEURON_URL, else {DEFAULT_URL})")
    p.add_argument("--api-key", default=None, help="inference key (default: $NEURON_API_KEY)")
    p.add_argument("--admin-key", default=None, help="admin key (default: $NEURON_ADMIN_API_KEY, else the api key)")


@dataclass
class Daemon:
    url: str
    api_key: str | None = None
    admin_key: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Daemon:
        return cls(url=args.url.rstrip("/"),
                   api_key=args.api_key or os.environ.get("NEURON_API_KEY") or None,
                   admin_key=args.admin_key or os.environ.get("NEURON_ADMIN_API_KEY") or None)

    def headers(self, admin: bool) -> dict[str, str]:
        key = (self.admin_key or self.api_key) if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def call(self, method: str, path: str, *, admin: bool, body: Any = None, timeout: float | None = 30.0,
             ok: tuple[int, ...] = (200,)) -> tuple[int, Any]:
        """(status, JSON body); any status outside ``ok`` raises CtlError with the server's message."""
        try:
            r = httpx.request(method, self.url + path, json=body, headers=self.headers(admin), timeout=timeout)
        except httpx.ConnectError:
            raise CtlError(f"cannot reach {self.url} (is `neuron serve` running there?)") from None
        except httpx.HTTPError as exc:
            raise CtlError(f"{method} {path} failed: {type(exc).__name__}: {exc}") from None
        try:
            data = r.json()
        except ValueError:
            data = None
        if r.status_code not in ok:
            raise CtlError(describe_error(r.status_code, data, r.text))
        return r.status_code, data


    def text(self, path: str, *, admin: bool) -> str:
        """A route's text answer (``/metrics``)."""
        try:
            r = httpx.get(self.url + path, headers=self.headers(admin), timeout=30.0)
        except httpx.HTTPError as exc:
            raise CtlError(f"GET {path} failed: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise CtlError(describe_error(r.status_code, None, r.text))
        return r.text


def describe_error(status: int, data: Any, text: str) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        err = data["error"]
        return f"{status} {err.get('code')}: {err.get('message')}"
    return f"HTTP {status}: {text[:300]}"
