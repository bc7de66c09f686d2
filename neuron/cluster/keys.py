"""The group key: one CURVE key pair the head's sockets serve with and one every node's ranks
connect with, in a file of mode 0600 that every node of the group is given."""

from __future__ import annotations

import logging
import os
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path

import zmq

log = logging.getLogger("neuron.cluster")

FIELDS = ("server_public", "server_secret", "client_public", "client_secret")


class GroupKeyError(ValueError):
    pass


@dataclass(frozen=True)
class GroupKey:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def server(self) -> tuple[bytes, bytes]:
        return self.server_public, self.server_secret

    @property
    def client(self) -> tuple[bytes, bytes, bytes]:
        """What a connecting socket takes: (server public, own public, own secret)."""
        return self.server_public, self.client_public, self.client_secret


def write_key(path: str | Path) -> Path:
    """A new group key at ``path`` (mode 0600 from its creation; an existing file is kept)."""
    path = Path(path)
    (spub, ssec), (cpub, csec) = zmq.curve_keypair(), zmq.curve_keypair()
    lines = ["# neuron group key: give this file to every node of the group, and to no one else"]
    lines += [f'{name} = "{value.decode()}"' for name, value in zip(FIELDS, (spub, ssec, cpub, csec))]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def read_key(path: str | Path) -> GroupKey:
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise GroupKeyError(f"cannot read the group key {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError:
        raise GroupKeyError(f"{path} is not a group key written by `neuron keygen`") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the group key %s is readable by others (mode %o): anyone who reads it can join the group",
                    path, stat.S_IMODE(mode))
    values = []
    for name in FIELDS:
        value = data.get(name)
        if not isinstance(value, str) or len(value) != 40:
            raise GroupKeyError(f"{path} is not a group key written by `neuron keygen` ({name} is missing or malformed)")
        values.append(value.encode())
    return GroupKey(*values)
