"""systemd's sd_notify protocol: one datagram to $NOTIFY_SOCKET (Type=notify units)."""

from __future__ import annotations

import os
import socket


def sd_notify(state: str) -> bool:
    """Sends e.g. "READY=1"; a no-op (False) when not started by systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True
