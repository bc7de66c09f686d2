"""Hosts on one machine for the multi-host tests: Linux network namespaces joined to this one by
veth pairs on a bridge. This namespace is the head's host (the bridge's address); each other
host is a namespace with one address on the same subnet. Needs root (CAP_NET_ADMIN)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise OSError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def why_not() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    name = f"nrnprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (OSError, FileNotFoundError) as exc:
        return f"cannot create a network namespace: {exc}"
    _ip("netns", "del", name)
    return None


@dataclass
class Hosts:
    """``count`` namespaces on the /24 ``prefix`` (default 10.<1xx>.0). With ``head_here`` this
    namespace is a host too, the head, at .1, and namespace i is at .(i+1); without, namespace i
    is at .i and namespace 1 is the head."""

    count: int
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    prefix: str = ""
    head_here: bool = True
    names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefix = self.prefix or f"10.{100 + os.getpid() % 100}.0"

    @property
    def head(self) -> str:
        return f"{self.prefix}.1"

    def address(self, i: int) -> str:
        return f"{self.prefix}.{i + 1 if self.head_here else i}"

    @property
    def bridge(self) -> str:
        return f"nrb{self.tag}"

    def link(self, i: int) -> str:
        """Host i's veth end on this side: down cuts host i off."""
        return f"nrh{self.tag}x{i}"

    def namespace(self, i: int) -> str:
        return f"neuron{self.tag}h{i}"

    def up(self) -> "Hosts":
        _ip("link", "add", self.bridge, "type", "bridge")
        if self.head_here:
            _ip("addr", "add", f"{self.head}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(1, self.count + 1):
            ns, outer, inner = self.namespace(i), self.link(i), f"nrv{self.tag}x{i}"
            _ip("netns", "add", ns)
            self.names.append(ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def cut(self, i: int) -> None:
        _ip("link", "set", self.link(i), "down")

    def mend(self, i: int) -> None:
        _ip("link", "set", self.link(i), "up")

    def run_in(self, i: int) -> list[str]:
        """The command prefix that runs a command on host i."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def down(self) -> None:
        for i, ns in enumerate(self.names, 1):
            subprocess.run(["ip", "link", "del", self.link(i)], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.names.clear()

    def __enter__(self) -> "Hosts":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()
