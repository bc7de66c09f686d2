"""The HTTP port of an engine core and its API processes."""

from __future__ import annotations

import socket

from .config import Config


def port_socket(cfg: Config, listening: bool) -> socket.socket:
    """A socket on the HTTP port in its SO_REUSEPORT group: each API process listens on one of
    its own, and the kernel spreads new connections over them evenly (one shared socket hands
    most of them to whichever process wakes first). The core holds one that does not listen: it
    keeps the port ours and finds it taken before any API process starts."""
    family, kind, proto, _, address = socket.getaddrinfo(cfg.server.host or None, cfg.server.port,
                                                         type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        if listening:
            sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock
