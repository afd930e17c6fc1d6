"""Which network interface holds an address: Gloo and NCCL are told to listen there, and nowhere else."""

from __future__ import annotations

import socket


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` (Linux), or None when unknown or a wildcard."""
    if address in ("", "0.0.0.0", "::"):
        return None
    try:
        wanted = {str(info[4][0]) for info in socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)}
    except OSError:
        return None
    if any(a.startswith("127.") for a in wanted) or "::1" in wanted:
        return "lo"
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) in wanted:
                return name
    return None
