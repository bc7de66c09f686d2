"""Finding markers (``<think>``, ``<tool_call>``, ...) in text that arrives in pieces: text that
could be the start of a marker is held back until the next piece says whether it is one."""

from __future__ import annotations


def partial_at_end(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` are a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def split_at(buf: str, marker: str) -> tuple[str, bool, str]:
    """(text before the marker or safe to pass on, whether the marker was found, the rest: what
    follows the marker, or the held-back partial marker)."""
    at = buf.find(marker)
    if at >= 0:
        return buf[:at], True, buf[at + len(marker):]
    keep = partial_at_end(buf, marker)
    return buf[: len(buf) - keep], False, buf[len(buf) - keep:]
