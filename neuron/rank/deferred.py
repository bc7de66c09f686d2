"""A reply that exists once the device has finished a launched step."""

from __future__ import annotations

from typing import Callable


class Deferred:
    """``wait`` (run on the rank's collector thread) blocks until the reply is ready and returns it."""

    def __init__(self, wait: Callable[[], object]) -> None:
        self.wait = wait
