"""Where the daemon listens and how to talk to it: address parsing, channel options, auth metadata.

Sans-IO: nothing here opens a socket; both clients build their channel from these values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from corral.sdk.errors import InvalidArgument

DEFAULT_SOCKET_PATH = "/run/corral/corral.sock"
DEFAULT_ADDRESS = f"unix://{DEFAULT_SOCKET_PATH}"

# CORRAL_ADDRESS takes any address form; CORRAL_SOCKET is a socket path (the daemon reads the same
# variable to decide where to listen, so a client started beside it finds it).
ADDRESS_ENV = "CORRAL_ADDRESS"
SOCKET_ENV = "CORRAL_SOCKET"
TOKEN_ENV = "CORRAL_TOKEN"


@dataclass(frozen=True)
class DaemonAddress:
    """A parsed daemon address: a Unix socket path, or a TCP host and port."""

    transport: Literal["unix", "tcp"]
    # The socket path for "unix", "host:port" for "tcp" (IPv6 hosts in brackets).
    location: str

    @property
    def grpc_target(self) -> str:
        """The target string grpc's channel constructors take."""
        if self.transport == "unix":
            # grpc reads "unix:///abs/path" as absolute and "unix:rel/path" as relative.
            return f"unix://{self.location}" if self.location.startswith("/") else f"unix:{self.location}"
        return self.location

    def __str__(self) -> str:
        return self.grpc_target if self.transport == "unix" else f"tcp://{self.location}"


def resolve_address(address: str | None = None, environ: Mapping[str, str] | None = None) -> DaemonAddress:
    """Parses an explicit address, else CORRAL_ADDRESS, else CORRAL_SOCKET, else the default socket.

    Accepted forms: "unix:///path", "unix:path", "/path" or "./path" (Unix socket), and
    "host:port", "tcp://host:port", "[::1]:port" (TCP).
    """
    env = os.environ if environ is None else environ
    if address is None:
        address = env.get(ADDRESS_ENV) or env.get(SOCKET_ENV) or DEFAULT_ADDRESS
    return parse_address(address)


def parse_address(address: str) -> DaemonAddress:
    text = address.strip()
    if not text:
        raise InvalidArgument("the daemon address is empty")
    if text.startswith("unix://"):
        return _unix(text.removeprefix("unix://"), address)
    if text.startswith("unix:"):
        return _unix(text.removeprefix("unix:"), address)
    if text.startswith(("/", "./", "../", "~")):
        return _unix(os.path.expanduser(text), address)
    if text.startswith("tcp://"):
        return _tcp(text.removeprefix("tcp://"), address)
    if "://" in text:
        raise InvalidArgument(
            f"unsupported daemon address {address!r}: use unix:///path, /path, host:port or tcp://host:port"
        )
    return _tcp(text, address)


def _unix(path: str, original: str) -> DaemonAddress:
    if not path:
        raise InvalidArgument(f"daemon address {original!r} has no socket path")
    return DaemonAddress("unix", path)


def _tcp(host_port: str, original: str) -> DaemonAddress:
    host, separator, port = host_port.rstrip("/").rpartition(":")
    if not separator or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"daemon address {original!r} is not host:port, a unix:// URL or a socket path")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise InvalidArgument(f"daemon address {original!r}: write IPv6 hosts in brackets, e.g. [::1]:{port}")
    return DaemonAddress("tcp", f"{host}:{int(port)}")


def resolve_token(token: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The bearer token to send: the explicit one, else CORRAL_TOKEN, else none."""
    env = os.environ if environ is None else environ
    return token if token is not None else (env.get(TOKEN_ENV) or None)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the bearer token the daemon's TCP listener checks."""
    if not token:
        return ()
    return (("authorization", f"Bearer {token}"),)


def channel_options() -> list[tuple[str, int | str]]:
    """Options for the gRPC channel of either client."""
    return [
        # The daemon enforces its own caps (file reads, output limits) and answers
        # RESOURCE_EXHAUSTED past them; a second, smaller client-side cap would only make large
        # reads and writes fail with a less helpful message.
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", -1),
        ("grpc.primary_user_agent", "corral-sdk-python"),
        # HTTP/2 keepalive pings are deliberately not enabled: gRPC servers answer pings more
        # frequent than their policy with GOAWAY, and long quiet streams use the in-band
        # ExecKeepalive event instead.
    ]
