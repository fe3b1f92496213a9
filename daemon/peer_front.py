"""The Unix socket's front: who each connection is, from the kernel's peer credentials.

gRPC does not tell a Python server who is on the other end of a Unix socket: `context.peer()` is
"unix:" for every client, and `auth_context()` (local credentials included) carries no uid
(grpc/grpc#15511, #28755), while grpc python offers no way to hand the server an accepted socket
of our own. So the daemon accepts on the public socket itself, reads SO_PEERCRED (pid, uid, gid)
and SO_PEERGROUPS of each connection as it accepts it, and relays the connection's bytes to the
gRPC server's private socket from a client socket bound to a fresh abstract name: gRPC reports
that name as the call's peer ("unix-abstract:NAME"), and the name maps to the credentials read.
What makes this sound:
- only the daemon can connect to the private socket (in a 0700 directory of the state directory,
  which sandboxes never see), so every peer name gRPC reports is one this front bound;
- each name is 128 random bits, never reused, registered before its connection is made and
  dropped before its socket is closed, so a name never maps to another connection's credentials;
- a call whose peer names no live connection of the front is refused (UNAUTHENTICATED).
The relay costs a few tens of microseconds per message on this machine (docs/deploy.md, "A shared
daemon").
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .callers import Caller, the_daemon, uid_owner

log = logging.getLogger(__name__)

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
MAX_PEER_GROUPS = 65536
ABSTRACT_PEER = "unix-abstract:"
PRIVATE_SOCKET = "grpc.sock"


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]  # supplementary groups at connect time (empty where the kernel is older)


def read_peer_credentials(sock: socket.socket) -> PeerCredentials:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return PeerCredentials(pid, uid, gid, _peer_groups(sock))


def _peer_groups(sock: socket.socket) -> frozenset[int]:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, MAX_PEER_GROUPS * 4)
    except OSError:
        return frozenset()
    groups = array.array("I")
    groups.frombytes(raw[: len(raw) - len(raw) % 4])
    return frozenset(groups)


def caller_of(credentials: PeerCredentials, admin_gid: int | None) -> Caller:
    """The caller these credentials make: the daemon's own process is the daemon itself; root and
    members of the admin group are admins; anyone else is its uid."""
    if credentials.pid == os.getpid():
        return the_daemon()
    in_admin_group = admin_gid is not None and (admin_gid == credentials.gid or admin_gid in credentials.groups)
    return Caller(uid_owner(credentials.uid), admin=credentials.uid == 0 or in_admin_group)


class PeerFront:
    """Accepts on a listening Unix socket and relays each connection to the gRPC server's private
    socket (`grpc_address`), remembering its peer credentials under the name it relays from."""

    def __init__(self, private_dir: Path) -> None:
        _make_private_dir(private_dir)
        # The private socket is named through a descriptor of its directory: its path then fits
        # a socket address (108 bytes) however long the state directory's is.
        self._dir_fd = os.open(private_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.private_path = f"/proc/self/fd/{self._dir_fd}/{PRIVATE_SOCKET}"
        self._peers: dict[str, PeerCredentials] = {}
        self._server: asyncio.AbstractServer | None = None
        self._relays: set[_ClientSide] = set()

    @property
    def grpc_address(self) -> str:
        return f"unix:{self.private_path}"

    async def start(self, listener: socket.socket) -> None:
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: _ClientSide(self), sock=listener, backlog=1024
        )

    def credentials(self, peer: str) -> PeerCredentials | None:
        """The credentials of the connection gRPC names `peer` (context.peer()), None for a peer
        that is no live connection of this front."""
        if not peer.startswith(ABSTRACT_PEER):
            return None
        return self._peers.get(peer[len(ABSTRACT_PEER) :])

    async def close(self) -> None:
        """Stops accepting and closes every relayed connection."""
        if self._server is not None:
            self._server.close()
        for relay in list(self._relays):
            relay.close()
        with contextlib.suppress(OSError):
            os.close(self._dir_fd)

    async def _connect(self, relay: _ClientSide, credentials: PeerCredentials) -> None:
        loop = asyncio.get_running_loop()
        name = f"corral-peer-{secrets.token_hex(16)}"
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            upstream.bind(b"\0" + name.encode())
            upstream.setblocking(False)
            self._peers[name] = credentials  # before gRPC can see the connection
            relay.on_close = lambda: self._peers.pop(name, None)
            await loop.sock_connect(upstream, self.private_path)
            await loop.create_unix_connection(lambda: _ServerSide(relay), sock=upstream)
        except OSError as err:
            log.warning("cannot relay a connection of uid %d to the daemon's server: %s", credentials.uid, err)
            self._peers.pop(name, None)
            upstream.close()
            relay.close()

    def _track(self, relay: _ClientSide, live: bool) -> None:
        if live:
            self._relays.add(relay)
        else:
            self._relays.discard(relay)


def _make_private_dir(path: Path) -> None:
    """The private socket's directory, 0700 and the daemon's, made fresh each start (a leftover of
    an earlier run is replaced, never trusted)."""
    if path.is_symlink() or path.exists():
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            for entry in path.iterdir():
                entry.unlink()
            path.rmdir()
    path.mkdir(mode=0o700, parents=True)
    os.chmod(path, 0o700)


class _Relay(asyncio.Protocol):
    """One side of a relayed connection: what it receives is written to the other side, and a
    side whose writes back up stops the other from reading (flow control both ways)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.partner: _Relay | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.partner and self.partner.transport:
            self.partner.transport.write(data)

    def eof_received(self) -> bool:
        if self.partner and self.partner.transport and self.partner.transport.can_write_eof():
            self.partner.transport.write_eof()
        return True  # half-closed: the other direction goes on

    def pause_writing(self) -> None:
        if self.partner and self.partner.transport:
            self.partner.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.partner and self.partner.transport:
            self.partner.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.partner:
            self.partner.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _ClientSide(_Relay):
    """The caller's connection: its credentials are read as it is accepted, and what it sends
    before the relay to the gRPC server stands is kept for it (reading is paused meanwhile, but
    some Pythons, 3.11.2 among them, start reading after connection_made all the same)."""

    def __init__(self, front: PeerFront) -> None:
        super().__init__()
        self.front = front
        self.early: list[bytes] = []
        self.on_close: Callable[[], object] = lambda: None
        self.connecting: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        self.transport.pause_reading()
        self.front._track(self, True)
        try:
            credentials = read_peer_credentials(transport.get_extra_info("socket"))
        except OSError as err:
            log.warning("cannot read a caller's peer credentials: %s", err)
            self.close()
            return
        self.connecting = asyncio.ensure_future(self.front._connect(self, credentials))  # (held: not collected)

    def data_received(self, data: bytes) -> None:
        if self.partner is None:
            self.early.append(data)
        else:
            super().data_received(data)

    def started(self, partner: _Relay) -> None:
        self.partner = partner
        if self.transport is None:
            partner.close()
            return
        if partner.transport is not None:
            for data in self.early:
                partner.transport.write(data)
        self.early.clear()
        self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.front._track(self, False)
        # The name is forgotten before the relay's socket to gRPC is closed (by the partner's
        # close below), so it never names a connection that is gone.
        self.on_close()
        super().connection_lost(exc)


class _ServerSide(_Relay):
    """The relay's connection to the gRPC server."""

    def __init__(self, client: _ClientSide) -> None:
        super().__init__()
        self.partner = client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert isinstance(self.partner, _ClientSide)
        self.partner.started(self)

    def connection_lost(self, exc: Exception | None) -> None:
        # (The client side may be gone already; its name is dropped then too.)
        if isinstance(self.partner, _ClientSide):
            self.partner.on_close()
        super().connection_lost(exc)
