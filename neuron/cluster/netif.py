"""Which local network interface reaches an address: the collectives (gloo, NCCL) must use it,
not whatever the host name resolves to (another network, or nothing inside a container)."""

from __future__ import annotations

import fcntl
import socket
import struct

SIOCGIFADDR = 0x8915


def local_address_to(addr: str) -> str:
    """This host's address on the route to ``addr`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface that holds IPv4 ``address``, if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def collective_env(master_addr: str) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for the interface that reaches the head, unless
    the operator set them."""
    name = interface_of(local_address_to(socket.gethostbyname(master_addr)))
    if name is None:
        return {}
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}
