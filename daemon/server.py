"""`corral serve`: wires the daemon together and runs it until SIGTERM/SIGINT.

Startup: state dir and crash recovery first, then the gRPC servers (the Unix socket's, and an
optional bounded one for TCP with a bearer token; both with health and reflection), then READY=1
to systemd. Shutdown: health goes NOT_SERVING, new calls are refused, in-flight calls get the
grace period, every sandbox is destroyed, the socket is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from corral.sdk.errors import Unauthenticated
from corral.v1 import (
    kernel_pb2,
    kernel_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    sandbox_pb2,
    sandbox_pb2_grpc,
    shell_pb2,
    shell_pb2_grpc,
)

from .backends.base import Backend
from .callers import Caller, tcp_callers, the_daemon
from .cgroups import CgroupDriver
from .config import Config, TcpConfig, group_id
from .errors import map_errors
from .execs import ExecManager
from .files import FileManager
from .forks import ForkManager
from .interceptors import (
    CallerOf,
    GuardInterceptor,
    bearer_token,
    bearer_token_guard,
    caller_guard,
    known_token,
    metrics_guard,
)
from .kernels import KernelManager
from .metrics import Metrics
from .node import Node, make_backends
from .notify import sd_notify
from .peer_front import PeerFront, caller_of
from .processes import ProcessManager
from .reserved_signals import reset_ignored_reserved_signals
from .rollout_runtime import RolloutRuntime
from .sandboxes import SandboxManager
from .services.kernel import KernelServicer
from .services.rollout import RolloutServicer
from .services.sandbox import SandboxServicer
from .services.shell import ShellServicer
from .shells import ShellManager
from .state import StateStore
from .transfer import TarTransfer

log = logging.getLogger("corral.daemon")

MAX_MESSAGE_BYTES = 96 << 20  # above exec.max_file_bytes' default so a full ReadFile fits
BASE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVICE_NAMES = [
    sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].full_name,
    shell_pb2.DESCRIPTOR.services_by_name["ShellService"].full_name,
    kernel_pb2.DESCRIPTOR.services_by_name["KernelService"].full_name,
    rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name,
]


def reset_inherited_signals() -> None:
    """Signals the daemon's own launcher ignored (nohup: SIGHUP; some supervisors: SIGQUIT) would
    stay ignored in every process of every sandbox, since exec keeps ignored dispositions. The
    daemon goes on ignoring them, through a handler that does nothing, which exec resets to the
    default; and it unblocks every signal, since children inherit the mask too. glibc's own two
    signals, which Python cannot name, are reset apart (reserved_signals)."""
    if threading.current_thread() is not threading.main_thread():
        return  # an embedded daemon in a worker thread cannot change dispositions
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE):  # (children get SIGPIPE back: Popen)
            continue
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            if signal.getsignal(sig) is signal.SIG_IGN:
                signal.signal(sig, signal.SIG_DFL if sig == signal.SIGCHLD else _ignore)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    reset_ignored_reserved_signals()


def _ignore(signum: int, frame: object) -> None:
    pass


def tcp_options(tcp: TcpConfig) -> list[tuple[str, int]]:
    """What bounds TCP peers, authenticated or not: at most `max_connections` at once (gRPC
    closes further ones as it accepts them), `handshake_timeout_s` to open HTTP/2 (a socket that
    connects and sends nothing is closed then), and `idle_timeout_s` without a call before the
    connection is closed (GOAWAY; a client reconnects by itself on its next call)."""
    return [
        ("grpc.max_allowed_incoming_connections", tcp.max_connections),
        ("grpc.server_handshake_timeout_ms", int(tcp.handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", int(tcp.idle_timeout_s * 1000)),
    ]


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def listen_on_socket(path: Path, mode: int, group: int | None) -> socket.socket:
    """The daemon's listening Unix socket, created with `mode` and given to `group` (None: the
    daemon's own) before it listens: nobody can connect while it is still root's alone, and its
    mode is never wider for a moment."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        with _umask(0o777 & ~mode):
            sock.bind(str(path))
        if group is not None:
            os.chown(path, -1, group)
        os.chmod(path, mode)
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


class DaemonAlreadyRunning(RuntimeError):
    pass


def _claim_socket(path: Path) -> None:
    """Removes a stale socket file; refuses to steal one that a live daemon still answers on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        raise DaemonAlreadyRunning(f"another daemon is serving on {path}")
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
    finally:
        probe.close()


class Daemon:
    """The node daemon. `backend_classes` replaces the backend registry, and `caller_of` how
    the Unix socket's callers are told apart (tests: see corral.daemon.testing; by default, their
    peer credentials: peer_front)."""

    def __init__(
        self,
        config: Config,
        *,
        backend_classes: Mapping[str, type[Backend]] | None = None,
        caller_of: CallerOf | None = None,
    ) -> None:
        self.config = config
        self.state = StateStore(config.state_path)
        self.cgroups = CgroupDriver(
            self.state.daemon_id,
            sandboxes_cpu_weight=config.daemon.sandboxes_cpu_weight,
            sandbox_cpu_weight=config.limits.cpu_weight,
            oom_score_adj=config.limits.oom_score_adj,
        )
        self.socket_path = Path(config.daemon.socket).absolute()
        self.admin_gid = group_id(config.daemon.admin_group, "daemon.admin_group")
        self.front: PeerFront | None = None
        self._test_caller_of = caller_of
        self.unix_caller_of = caller_of or self._peer_caller
        hidden = [config.daemon.state_dir, str(self.socket_path.parent)]
        self.backends = make_backends(
            config,
            self.cgroups,
            self.state.daemon_id,
            hidden_paths=[p for p in hidden if p != "/"],
            backend_classes=backend_classes,
        )
        self.metrics = Metrics()
        self.metrics.watch_cgroups(self.cgroups.held)
        self.manager = SandboxManager(config, self.backends, self.state, self.metrics)
        self.files = FileManager(self.manager)
        self.execs = ExecManager(config, self.manager, self.files, self.metrics)
        self.forks = ForkManager(config, self.manager)
        self.shells = ShellManager(config, self.manager, self.files)
        self.processes = ProcessManager(config, self.manager, self.files)
        self.kernels = KernelManager(config, self.manager, self.files)
        self.rollouts = RolloutRuntime(config.rollout, self.socket_path, self.manager, self.metrics)
        self.node = Node(
            config, self.state.daemon_id, self.backends, self.cgroups, self.manager, self.rollouts.pipeline
        )
        self.health = health.aio.HealthServicer()
        self.servicers = {
            "kernel": KernelServicer(self.kernels),
            "rollout": RolloutServicer(self.rollouts),
            "shell": ShellServicer(self.shells, self.processes),
            "sandbox": SandboxServicer(
                self.manager, self.forks, self.execs, self.files, TarTransfer(self.files, self.execs), self.node
            ),
        }
        self.server: grpc.aio.Server | None = None  # the Unix socket's
        self.tcp_server: grpc.aio.Server | None = None
        self._socket_bound = False
        self._stop = asyncio.Event()

    async def start(self) -> None:
        reset_inherited_signals()
        await self.manager.start()
        # Callers on the Unix socket and over TCP get servers of their own, so that TCP peers
        # (anyone who can reach the port, token or not) can neither exhaust the connections nor
        # the file descriptors that the socket's callers need (see tcp_options).
        self.server = self._make_server(
            [
                metrics_guard(self.metrics),
                map_errors,
                caller_guard(self.unix_caller_of, self.config.daemon.admin_group),
            ],
            BASE_OPTIONS,
        )
        _claim_socket(self.socket_path)  # (first: a daemon that serves there keeps its front)
        mode = int(self.config.daemon.socket_mode, 8)
        group = group_id(self.config.daemon.socket_group, "daemon.socket_group")
        if self.shared_socket(mode, group):
            # The socket's callers reach the server through the front, which knows who each is.
            self.front = PeerFront(self.config.state_path / "front")
            self.server.add_insecure_port(self.front.grpc_address)
            listener = listen_on_socket(self.socket_path, mode, group)
            self._socket_bound = True
            await self.front.start(listener)
        else:
            with _umask(0o777 & ~mode):  # the socket is created with its mode, never wider for a moment
                self.server.add_insecure_port(f"unix:{self.socket_path}")
            self._socket_bound = True
            os.chmod(self.socket_path, mode)
        tcp = self.config.daemon.tcp
        if tcp.listen:
            callers = tcp_callers(self.config.token, self.config.tcp_tokens, all_admin=tcp.admin, admins=tcp.admins)

            def tcp_caller_of(context: grpc.aio.ServicerContext) -> Caller:
                # The bearer guard has let only these tokens in.
                return callers[known_token(bearer_token(context), callers) or ""]

            guards = [
                bearer_token_guard(list(callers)),
                metrics_guard(self.metrics),
                map_errors,
                caller_guard(tcp_caller_of),
            ]
            self.tcp_server = self._make_server(guards, [*BASE_OPTIONS, *tcp_options(tcp)])
            self.tcp_server.add_insecure_port(tcp.listen)
            await self.tcp_server.start()
        await self.server.start()
        await self.rollouts.start()
        for name in ["", *SERVICE_NAMES]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics.listen:
            self.metrics.serve_http(self.config.metrics.listen, self.config.metrics_token)
        log.info(
            "serving on unix:%s%s",
            self.socket_path,
            f" and tcp {self.config.daemon.tcp.listen}" if self.config.daemon.tcp.listen else "",
        )
        sd_notify("READY=1")

    def _make_server(self, guards: list, options: list[tuple[str, int]]) -> grpc.aio.Server:
        server = grpc.aio.server(interceptors=[GuardInterceptor(*guards)], options=options)
        kernel_pb2_grpc.add_KernelServiceServicer_to_server(self.servicers["kernel"], server)
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(self.servicers["rollout"], server)
        shell_pb2_grpc.add_ShellServiceServicer_to_server(self.servicers["shell"], server)
        sandbox_pb2_grpc.add_SandboxServiceServicer_to_server(self.servicers["sandbox"], server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        return server

    def shared_socket(self, mode: int, group: int | None) -> bool:
        """Whether users other than the daemon's own may open its socket (a socket_group, or a
        mode that lets others in): only then are callers told apart, through the front (a relay
        in the daemon's process, about 50 µs a call). A socket only the daemon's user (and its
        group, root's by default) may open has one caller, the daemon's user, an admin: calls
        go straight to gRPC. A `caller_of` given for tests stands in for the front."""
        return self._test_caller_of is None and (group is not None or bool(mode & 0o007))

    def _peer_caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller of a call on the Unix socket, from its connection's peer credentials; the
        daemon's own user where the socket is not shared (shared_socket)."""
        if self.front is None:
            return the_daemon()
        credentials = self.front.credentials(context.peer())
        if credentials is None:
            raise Unauthenticated("the daemon cannot tell who this caller is (no peer credentials)")
        return caller_of(credentials, self.admin_gid)

    def request_stop(self) -> None:
        self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    async def stop(self) -> None:
        sd_notify("STOPPING=1")
        await self.health.enter_graceful_shutdown()
        # Rollouts first: they end as FILTERED (SHUTDOWN) and free their sandboxes through the
        # socket, which must still serve.
        await self.rollouts.close()
        await asyncio.gather(
            *(server.stop(self.config.daemon.grace_period_s) for server in (self.server, self.tcp_server) if server)
        )
        if self.front:
            await self.front.close()
        await self.shells.close()
        await self.processes.close()
        await self.kernels.close()
        await self.manager.close()
        self.files.close()
        for backend in self.backends.values():
            await backend.close()
        if self._socket_bound:  # never remove the socket of another daemon we refused to replace
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self.cgroups.remove_base()
        log.info("stopped")


def protect_from_oom(score: int) -> None:
    """Writes the daemon's own oom_score_adj (daemon.oom_score_adj), so that the kernel's OOM
    killer takes sandbox processes (limits.oom_score_adj) before the daemon that would clean up
    after them. Lowering it needs CAP_SYS_RESOURCE: without it the daemon says so and goes on.
    Only `corral serve` does this; a daemon embedded in another program leaves that program's
    score alone."""
    if not score:
        return
    try:
        Path("/proc/self/oom_score_adj").write_text(str(score))
    except PermissionError:
        # Expected where the daemon is not root (or root without CAP_SYS_RESOURCE): said once, as
        # what it means rather than as an error.
        log.info(
            "the daemon keeps its inherited oom_score_adj (daemon.oom_score_adj = %d needs CAP_SYS_RESOURCE): "
            "under memory pressure the kernel may kill it before sandbox processes",
            score,
        )
        return
    except OSError as err:
        log.warning("cannot set the daemon's oom_score_adj to %d: %s", score, err.strerror or err)
        return
    log.info("the daemon's oom_score_adj is %d", score)


async def run_daemon(config: Config) -> None:
    protect_from_oom(config.daemon.oom_score_adj)
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    try:
        await daemon.start()
        await daemon.wait()
    finally:
        await daemon.stop()


def main(config: Config) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run_daemon(config))
