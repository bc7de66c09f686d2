"""The group key: CURVE key pairs for the head's sockets (server) and the ranks that connect to
them (client), in files of mode 0600.

``neuron keygen FILE`` writes two files: FILE, the head's (both pairs: the head serves, and its
own ranks connect like any node's), and FILE with ``.node`` before its suffix, the nodes' (the
server's public key and the client pair). A node can join the group with its file, but cannot
pose as the head: it never holds the server's secret. A key file that others can read is refused,
as ssh refuses such a private key."""

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
NODE_FIELDS = ("server_public", "client_public", "client_secret")


class GroupKeyError(ValueError):
    pass


@dataclass(frozen=True)
class GroupKey:
    server_public: bytes
    server_secret: bytes  # empty in a node's file
    client_public: bytes
    client_secret: bytes

    @property
    def server(self) -> tuple[bytes, bytes]:
        if not self.server_secret:
            raise GroupKeyError("this is a node's group key: it cannot serve as the head's")
        return self.server_public, self.server_secret

    @property
    def client(self) -> tuple[bytes, bytes, bytes]:
        """What a connecting socket takes: (server public, own public, own secret)."""
        return self.server_public, self.client_public, self.client_secret


def node_key_path(path: str | Path) -> Path:
    """Where ``write_key(path)`` puts the nodes' file: ``group.key`` -> ``group.node.key``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.node{path.suffix}" if path.suffix else f"{path.name}.node")


def _write(path: Path, header: str, values: dict[str, bytes]) -> None:
    lines = [header] + [f'{name} = "{value.decode()}"' for name, value in values.items()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_key(path: str | Path) -> tuple[Path, Path]:
    """A new group key: the head's file at ``path`` and the nodes' beside it (mode 0600 from
    their creation; existing files are kept: FileExistsError)."""
    path, node = Path(path), node_key_path(path)
    if node.exists():
        raise FileExistsError(str(node))
    (spub, ssec), (cpub, csec) = zmq.curve_keypair(), zmq.curve_keypair()
    values = dict(zip(FIELDS, (spub, ssec, cpub, csec)))
    _write(path, "# neuron group key of the head: keep it on the head only", values)
    try:
        _write(node, "# neuron group key of the nodes: give this file to every other node of the group",
               {name: values[name] for name in NODE_FIELDS})
    except OSError:
        path.unlink()
        raise
    return path, node


def read_key(path: str | Path, *, head: bool) -> GroupKey:
    """The key in ``path``; ``head``: the head's file is needed (a node's cannot serve)."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise GroupKeyError(f"cannot read the group key {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        raise GroupKeyError(f"{path} is not a group key written by `neuron keygen`") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise GroupKeyError(f"the group key {path} is open to others (mode {stat.S_IMODE(mode):o}): anyone who "
                            f"reads it could join the group; make it readable by its owner only (chmod 600 {path})")
    if head and "server_secret" not in data and "server_public" in data:
        raise GroupKeyError(f"{path} is a node's group key: the head needs the head's file")
    needed = FIELDS if head or "server_secret" in data else NODE_FIELDS
    values = {}
    for name in needed:
        value = data.get(name)
        if not isinstance(value, str) or len(value) != 40:
            raise GroupKeyError(f"{path} is not a group key written by `neuron keygen` ({name} is missing or malformed)")
        values[name] = value.encode()
    return GroupKey(values["server_public"], values.get("server_secret", b""), values["client_public"],
                    values["client_secret"])
