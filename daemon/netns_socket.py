"""Listening sockets inside a sandbox's network namespace, served by the daemon.

A harness running in a sandbox without network must still reach the daemon's LLM gateway, and
nothing else. The daemon makes a TCP socket in the sandbox's own network namespace, bound to
127.0.0.1 there, and serves it from its own event loop: a socket keeps the namespace it was
created in, so connections the sandbox makes to its loopback arrive at the daemon, while the
sandbox still has no route anywhere.

Creating it takes a thread that enters the namespace (setns, which Python 3.11's os module lacks)
and then returns to the daemon's own. The thread is made for that one socket and ends with it:
a pooled thread must never be left in a sandbox's namespace if the return failed.

A daemon without root may not enter a network namespace owned by a sandbox's user namespace from
its own (setns needs CAP_SYS_ADMIN where the caller is, too). It owns that user namespace, so a
child process may join it and then the network namespace: this module, run by nsenter that way
(`python -I -S netns_socket.py HOST FD`, standard library only), makes the socket there and hands
it back over a socket pair (SCM_RIGHTS).
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import os
import socket
import struct
import subprocess
import sys
import threading

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
_libc = ctypes.CDLL(None, use_errno=True)


def shares_host_network(pid: int) -> bool:
    """Whether process `pid` is in the daemon's own network namespace (the sandbox has the host's
    network: apptainer with network on, the local backend without isolation)."""
    mine = os.stat("/proc/self/ns/net")
    theirs = os.stat(f"/proc/{pid}/ns/net")
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"setns: {os.strerror(number)}")


def _loopback_up() -> None:
    """Sets the loopback interface of the current network namespace up (a namespace made with a
    bare unshare has it down; one made by bwrap or a container engine has it up already)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH", b"lo", 0)
        (flags,) = struct.unpack_from("H", fcntl.ioctl(probe, SIOCGIFFLAGS, request), 16)
        if not flags & IFF_UP:
            fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def _listen_in_namespace(pid: int, host: str) -> socket.socket:
    """In the calling thread: enters pid's network namespace, makes a listening socket on
    host:<free port>, and goes back to the namespace the thread was in."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            listener = _make_listener(host)
        finally:
            _setns(own)
    finally:
        os.close(own)
    return listener


# How long the child that makes the socket for a daemon without root may take.
CHILD_TIMEOUT_S = 30.0


def _make_listener(host: str) -> socket.socket:
    _loopback_up()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(128)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


async def listen_in_namespace_of(pid: int, host: str = "127.0.0.1") -> socket.socket:
    """A listening TCP socket on host:<free port> in the network namespace of process `pid`. Raises
    OSError when the namespace cannot be entered (the process is gone) or the bind fails."""
    if os.geteuid() != 0:
        return await _listen_through_child(pid, host)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[socket.socket] = loop.create_future()

    def work() -> None:
        try:
            result = _listen_in_namespace(pid, host)
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, done, None, error)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    threading.Thread(target=work, name=f"netns-listen-{pid}", daemon=True).start()
    return await done


def _settle(future: asyncio.Future[socket.socket], result: socket.socket | None, error: BaseException | None) -> None:
    if future.cancelled():
        if result is not None:
            result.close()
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert result is not None
        future.set_result(result)


async def _listen_through_child(pid: int, host: str) -> socket.socket:
    """The socket made by a child that joined pid's user and network namespaces (a daemon
    without root); OSError saying why when it could not."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        argv = [
            "nsenter", f"--target={pid}", "--user", "--net", "--preserve-credentials", "--",
            sys.executable, "-I", "-S", os.path.abspath(__file__), host, str(theirs.fileno()),
        ]  # fmt: skip
        try:
            child = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
            )
        except FileNotFoundError as error:
            raise OSError(error.errno, "nsenter is not installed (util-linux)") from None
        theirs.close()
        try:
            _, stderr = await asyncio.wait_for(child.communicate(), CHILD_TIMEOUT_S)
        except TimeoutError:
            child.kill()
            await child.wait()
            raise OSError(f"making a socket in the namespace of process {pid} took over {CHILD_TIMEOUT_S:g}s") from None
        ours.setblocking(False)
        try:
            _, fds, _, _ = socket.recv_fds(ours, 16, 1)
        except BlockingIOError:
            fds = []
        if child.returncode != 0 or not fds:
            for fd in fds:
                os.close(fd)
            said = stderr.decode(errors="replace").strip()[-300:]
            raise OSError(f"could not make a socket in the namespace of process {pid}: {said or 'no socket came back'}")
        listener = socket.socket(fileno=fds[0])
        listener.setblocking(False)
        return listener
    finally:
        ours.close()
        theirs.close()


def _child_main(host: str, fd: int) -> None:
    """In the child that nsenter put in the sandbox's namespaces: makes the listener and sends it."""
    listener = _make_listener(host)
    with socket.socket(fileno=fd) as channel:
        socket.send_fds(channel, [b"socket"], [listener.fileno()])


if __name__ == "__main__":
    _child_main(sys.argv[1], int(sys.argv[2]))
