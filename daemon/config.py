"""Daemon configuration: a TOML file, then environment variables, then command-line flags.

deploy/corral.toml documents every key with its default; `Config` mirrors it section by section.
The sections of backends ([local], [docker], ...) are the `Settings` type each backend declares in
its own module, found through the backend registry.
"""

from __future__ import annotations

import dataclasses
import grp
import logging
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .backends.registry import BACKENDS
from .users import INSIDE_ID_COUNT

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/corral/corral.sock"
DEFAULT_STATE_DIR = "/var/lib/corral"


@dataclass
class TcpConfig:
    listen: str = ""
    token_file: str = ""
    # Bounds on TCP peers (daemon/server.py, tcp_options): they keep the daemon's connections and
    # file descriptors for the Unix socket's callers whatever reaches the port.
    max_connections: int = 256
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    # TCP callers are one identity, the token's owner ("tcp"): they see only the sandboxes and
    # snapshots made over TCP, unless this makes them admins, who see everything.
    admin: bool = False
    # Named tokens, one identity each ("tcp:NAME"): a file of `NAME TOKEN` lines (blank lines and
    # `#` comments ignored), beside or instead of token_file's one token.
    tokens_file: str = ""
    # Names of tokens_file whose callers are admins.
    admins: list[str] = field(default_factory=list)


@dataclass
class DaemonConfig:
    socket: str = DEFAULT_SOCKET
    socket_mode: str = "0660"
    # The group of the socket ("": the daemon's own): its members may connect (with socket_mode's
    # group bits) and each sees only what it made (daemon/callers.py).
    socket_group: str = ""
    # Members of this group ("": none) see and act on every caller's sandboxes, as root does.
    admin_group: str = ""
    state_dir: str = DEFAULT_STATE_DIR
    grace_period_s: float = 10.0
    default_backend: str = "local"
    max_sandboxes: int = 1000
    # Admission against the node's memory: the memory limits of the sandboxes on this node may add
    # up to this factor times its physical memory (a sandbox without a limit counts as all of it);
    # 0 admits whatever fits under max_sandboxes. 16: the rollout service's 64 RUN workers at the
    # 4 GiB default limit fit on a 16 GiB node, while 1,000 such sandboxes on 24 GiB do not.
    memory_overcommit: float = 16.0
    # The daemon's own oom_score_adj, written at `corral serve` start (0: left as inherited), so
    # that the kernel's OOM killer takes sandbox processes (limits.oom_score_adj) first.
    oom_score_adj: int = -500
    # The CPU weight (cgroup v2's scale, 1-10000; the kernel's default is 100) of the group that
    # holds every sandbox, against the rest of the node, the daemon among it; 0: the default.
    sandboxes_cpu_weight: int = 50
    tcp: TcpConfig = field(default_factory=TcpConfig)


@dataclass
class MetricsConfig:
    listen: str = ""
    token_file: str = ""  # when set, scrapes must send `Authorization: Bearer <its content>`


@dataclass
class ExecConfig:
    default_timeout_s: float = 600.0
    max_timeout_s: float = 86400.0
    default_output_limit_bytes: int = 1 << 20
    max_output_limit_bytes: int = 64 << 20
    max_file_bytes: int = 64 << 20


@dataclass
class KernelConfig:
    """Python kernels (docs/kernels.md)."""

    # A cell sent to a dead kernel restarts it first (unless StartKernel asked otherwise), at most
    # this many times within the window; past it, cells get FAILED_PRECONDITION until
    # RestartKernel, so a kernel that dies at every cell does not restart forever. 0: never.
    max_auto_restarts: int = 5
    auto_restart_window_s: float = 60.0


@dataclass
class SandboxConfig:
    """Settings every backend shares."""

    workdir: str = "/workspace"  # the writable working directory inside sandboxes
    # Host ids handed to sandboxes, [uid_base, uid_base + uid_count): a block of 65536 each (ids
    # 0..65535 inside its user namespace, daemon/uids.py), so 4096 sandboxes at once by default.
    uid_base: int = 1_500_000
    uid_count: int = 65536 * 4096
    # Host directories under which CreateSandbox may bind-mount host paths (daemon/mounts.py);
    # empty: no bind mounts at all.
    bind_roots: list[str] = field(default_factory=list)


@dataclass
class LimitsConfig:
    memory_bytes: int = 4 << 30
    pids: int = 1024
    cpu_millicores: int = 0
    # Each sandbox's CPU weight among the others (cgroup v2's scale, 1-10000; v1's cpu.shares and
    # Docker's cpu_shares get 1024 for 100), written into every sandbox's group.
    cpu_weight: int = 100
    # What every sandbox process gets as its oom_score_adj (-1000..1000; 0: left as inherited).
    oom_score_adj: int = 500
    idle_timeout_s: float = 0.0
    # The size of each sandbox's writable space where the backend can cap it (docs/local-backend.md);
    # 0: no cap.
    disk_bytes: int = 4 << 30


@dataclass
class RolloutConfig:
    # "byte" (the built-in byte-level tokenizer, what builtin LLM policies speak) or the local
    # directory of a Hugging Face tokenizer with a chat template.
    tokenizer: str = "byte"
    init_workers: int = 8
    run_workers: int = 64
    eval_workers: int = 8
    # Per stage, counted from when a worker takes a rollout; a task's own limits override them.
    init_timeout_s: float = 300.0
    run_timeout_s: float = 1800.0
    eval_timeout_s: float = 600.0
    queue_size: int = 1024
    init_retries: int = 2
    # INIT once: the samples of a submission (and tasks sharing a setup key) set up one sandbox
    # and fork it (docs/rollouts.md); off: every rollout runs its own INIT.
    init_once: bool = True
    # One LLM request: its timeout and how many servers to try before the rollout is filtered.
    llm_timeout_s: float = 600.0
    llm_attempts: int = 3
    # How long one LLM request waits, in all, for a server to come back when every server is out
    # of rotation (a restart), before it spends its remaining attempts anyway.
    llm_unavailable_wait_s: float = 60.0
    # HOST:PORT of the LLM gateway that harness tasks on the node talk to (port 0: any free one).
    # A loopback address: a harness's key is its only credential.
    gateway_listen: str = "127.0.0.1:0"
    # Whether harness tasks may run their command on the node (as the daemon's user, outside any
    # sandbox). Off: only harness tasks placed in the sandbox run; the others are refused.
    allow_host_harness: bool = False


@dataclass
class PoolsConfig:
    """What every warm pool shares (daemon/pools.py)."""

    # Pool sandboxes being started at once, over all pools: refilling never takes more of the
    # node than this, however many sandboxes were just taken.
    max_starting: int = 2
    # After a pool sandbox fails to start, the pool waits this long before its next try, doubling
    # with each failure in a row up to retry_max_s (a broken image must not spin).
    retry_initial_s: float = 1.0
    retry_max_s: float = 60.0


@dataclass
class AdmissionConfig:
    """Bounds on how fast the node takes new sandboxes (daemon/admission.py): past them
    CreateSandbox is RESOURCE_EXHAUSTED with a retry hint, so that a burst of creates waits at
    its callers instead of piling starts onto the node."""

    # Sandboxes being created at once (a create served from a warm pool starts nothing and does
    # not count); 0: no cap.
    max_starting: int = 0
    # Creates per second, as a token bucket of `create_burst` tokens (0: one second's worth) that
    # refills at this rate; creates served from a warm pool count. 0: no cap.
    max_creates_per_s: float = 0.0
    create_burst: int = 0


@dataclass
class LeasesConfig:
    """Leases and idempotency keys of CreateSandbox (docs/backends.md, "Node capacity, leases,
    admission, drain")."""

    # The longest lease a create or RenewLease may ask for.
    max_ttl_s: float = 86400.0
    # How long after its create an idempotency key is remembered at most (while its sandbox lives).
    idempotency_window_s: float = 600.0


@dataclass
class PoolEntry:
    """One [[pool]]: `size` ready sandboxes that a CreateSandbox request is served from when its
    backend, image, limits, network, env and user equal these (after the node's defaults fill in
    what either leaves empty) and it asks for no bind mounts."""

    name: str = ""  # in metrics and GetNodeInfo; empty: "pool<N>", N its place in the file
    size: int = 1
    backend: str = ""  # empty: daemon.default_backend
    image: str = ""  # empty: the backend's default image
    memory_bytes: int = 0  # the limits; 0: the node's default, as in a request
    pids: int = 0
    cpu_millicores: int = 0
    disk_bytes: int = 0
    network: bool = False
    user: str = ""
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    exec: ExecConfig = field(default_factory=ExecConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    leases: LeasesConfig = field(default_factory=LeasesConfig)
    # The [[pool]] entries, in file order.
    pool: list[PoolEntry] = field(default_factory=list)
    # One section per registered backend, named after it ([local], [docker], ...): the settings
    # type each backend declares (Backend.Settings).
    backends: dict[str, Any] = field(default_factory=lambda: {name: cls.Settings() for name, cls in BACKENDS.items()})
    # The bearer token for the TCP listener (from token_file or CORRAL_TOKEN); never from TOML text.
    token: str = ""
    # The named tokens of daemon.tcp.tokens_file, token -> name; never from TOML text.
    tcp_tokens: dict[str, str] = field(default_factory=dict)
    # The bearer token of the metrics endpoint (from metrics.token_file); empty: no authentication.
    metrics_token: str = ""

    @property
    def state_path(self) -> Path:
        return Path(self.daemon.state_dir)

    def backend(self, name: str) -> Any:
        """The settings section of a registered backend."""
        return self.backends[name]


class ConfigError(ValueError):
    """The configuration is malformed; the message names the key."""


def _same_kind(default: Any, value: Any) -> bool:
    """A TOML value fits a key when it has the default's type (an integer fits a float key; a
    boolean never fits a number key, though Python counts bool as int)."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


# Config fields that a TOML file cannot set: the token comes from a file or the environment (never
# from configuration text), and backend sections are merged by their own names.
_NOT_FROM_TOML = frozenset({"token", "tcp_tokens", "metrics_token", "backends"})


def _merge_file(config: Config, values: dict[str, Any]) -> None:
    """Merges a parsed TOML file: the daemon's sections, then one section per backend."""
    for key, value in values.items():
        if key in config.backends:
            if not isinstance(value, dict):
                raise ConfigError(f"{key} must be a table")
            _merge(config.backends[key], value, f"{key}.")
        elif key == "pool":
            config.pool = _pool_entries(value)
        else:
            _merge(config, {key: value}, "")


def _pool_entries(values: Any) -> list[PoolEntry]:
    """The [[pool]] array of tables; an entry's env is a table of strings."""
    if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
        raise ConfigError("pool must be an array of tables ([[pool]])")
    entries = []
    for index, value in enumerate(values):
        entry = PoolEntry(name=f"pool{index}")
        env = value.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ConfigError(f"pool[{index}].env must be a table of strings")
        _merge(entry, {k: v for k, v in value.items() if k != "env"}, f"pool[{index}].")
        entry.env = dict(env)
        entries.append(entry)
    return entries


def _merge(target: Any, values: dict[str, Any], where: str) -> None:
    known = {
        f.name: f for f in dataclasses.fields(target) if not (target.__class__ is Config and f.name in _NOT_FROM_TOML)
    }
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown configuration key {where}{key}")
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{key} must be a table")
            _merge(current, value, f"{where}{key}.")
        elif not _same_kind(current, value):
            raise ConfigError(f"{where}{key} must be {type(current).__name__}, got {type(value).__name__}")
        else:
            setattr(target, key, type(current)(value))


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    socket: str | None = None,
    state_dir: str | None = None,
    tcp_listen: str | None = None,
    token_file: str | None = None,
    metrics_listen: str | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Builds the configuration: defaults < TOML file < environment < explicit arguments (flags)."""
    env = os.environ if environ is None else environ
    config = Config()
    path = path or env.get("CORRAL_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                values = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"cannot read configuration {path}: {err}") from err
        for message in _move_deprecated_keys(values):
            log.warning("%s: %s", path, message)
        _merge_file(config, values)
    config.daemon.socket = socket or env.get("CORRAL_SOCKET") or config.daemon.socket
    config.daemon.state_dir = state_dir or env.get("CORRAL_STATE_DIR") or config.daemon.state_dir
    if tcp_listen is not None:
        config.daemon.tcp.listen = tcp_listen
    if token_file is not None:
        config.daemon.tcp.token_file = token_file
    if metrics_listen is not None:
        config.metrics.listen = metrics_listen
    if config.daemon.tcp.token_file:
        config.token = _read_token(config.daemon.tcp.token_file)
    config.token = config.token or env.get("CORRAL_TOKEN", "")
    if config.daemon.tcp.tokens_file:
        config.tcp_tokens = _read_named_tokens(config.daemon.tcp.tokens_file)
    if config.metrics.token_file:
        config.metrics_token = _read_token(config.metrics.token_file)
    validate(config)
    return config


def _read_token(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as err:
        raise ConfigError(f"cannot read token file {path}: {err}") from err


_TOKEN_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def _read_named_tokens(path: str) -> dict[str, str]:
    """daemon.tcp.tokens_file's `NAME TOKEN` lines as token -> name."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ConfigError(f"cannot read tokens file {path}: {err}") from err
    tokens: dict[str, str] = {}
    names: set[str] = set()
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2 or not _TOKEN_NAME.fullmatch(fields[0]):
            raise ConfigError(f"{path}:{number}: expected `NAME TOKEN` (a name of letters, digits and ._@-)")
        name, token = fields
        if name in names or token in tokens:
            raise ConfigError(f"{path}:{number}: the name or the token of {name!r} is used twice")
        names.add(name)
        tokens[token] = name
    return tokens


# Keys that moved, (section, key) -> (section, key). The old spelling keeps working for a release,
# with a warning.
MOVED_KEYS = {
    ("local", "workdir"): ("sandbox", "workdir"),
    ("local", "uid_base"): ("sandbox", "uid_base"),
    ("local", "uid_count"): ("sandbox", "uid_count"),
}


def _move_deprecated_keys(values: dict[str, Any]) -> list[str]:
    """Rewrites old keys in a parsed TOML file to their new places; returns one message per key
    moved. A key given in both places keeps the new one."""
    messages = []
    for (old_section, old_key), (new_section, new_key) in MOVED_KEYS.items():
        section = values.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        value = section.pop(old_key)
        target = values.setdefault(new_section, {})
        if isinstance(target, dict):
            target.setdefault(new_key, value)
        messages.append(
            f"{old_section}.{old_key} is deprecated and will be removed in the next release: "
            f"use {new_section}.{new_key}"
        )
    return messages


def validate(config: Config) -> None:
    if config.daemon.tcp.listen and not config.token and not config.tcp_tokens:
        raise ConfigError(
            "daemon.tcp.listen is set but no bearer token is configured: set daemon.tcp.token_file, "
            "daemon.tcp.tokens_file or CORRAL_TOKEN (the TCP listener never starts without one)"
        )
    if config.token and config.token in config.tcp_tokens:
        raise ConfigError("daemon.tcp.token_file's token is also one of daemon.tcp.tokens_file's")
    unknown_admins = set(config.daemon.tcp.admins) - set(config.tcp_tokens.values())
    if unknown_admins:
        raise ConfigError(
            f"daemon.tcp.admins names no token of daemon.tcp.tokens_file: {', '.join(sorted(unknown_admins))}"
        )
    for name, settings in config.backends.items():
        try:
            settings.validate()
        except ValueError as err:
            raise ConfigError(f"{name}.{err}") from None
    if config.daemon.default_backend not in BACKENDS:
        raise ConfigError(f"daemon.default_backend must be one of {', '.join(BACKENDS)}")
    if not config.sandbox.workdir.startswith("/"):
        raise ConfigError("sandbox.workdir must be an absolute path")
    for root in config.sandbox.bind_roots:
        if not isinstance(root, str) or not root.startswith("/") or "\0" in root:
            raise ConfigError(f"sandbox.bind_roots must hold absolute host paths, got {root!r}")
    if config.sandbox.uid_count < INSIDE_ID_COUNT:
        raise ConfigError(
            f"sandbox.uid_count must be at least {INSIDE_ID_COUNT} (one sandbox's block of host ids), "
            f"got {config.sandbox.uid_count}"
        )
    if config.kernel.max_auto_restarts < 0 or config.kernel.auto_restart_window_s <= 0:
        raise ConfigError(
            "kernel.max_auto_restarts must be 0 (never) or more and kernel.auto_restart_window_s positive"
        )
    for stage in ("init", "run", "eval"):
        if getattr(config.rollout, f"{stage}_workers") < 1:
            raise ConfigError(f"rollout.{stage}_workers must be at least 1")
    try:
        gateway_address(config.rollout.gateway_listen)
    except ValueError as err:
        raise ConfigError(f"rollout.gateway_listen: {err}") from None
    if config.metrics.token_file and not config.metrics_token:
        raise ConfigError(f"metrics.token_file {config.metrics.token_file} is empty")
    tcp = config.daemon.tcp
    if tcp.max_connections < 1 or tcp.handshake_timeout_s <= 0 or tcp.idle_timeout_s <= 0:
        raise ConfigError(
            "daemon.tcp.max_connections must be at least 1, and daemon.tcp.handshake_timeout_s and "
            "daemon.tcp.idle_timeout_s positive"
        )
    _validate_node_protection(config)
    _validate_pools(config)
    _validate_admission(config)
    try:
        int(config.daemon.socket_mode, 8)
    except ValueError as err:
        raise ConfigError('daemon.socket_mode must be an octal string such as "0660"') from err
    for key in ("socket_group", "admin_group"):
        group_id(getattr(config.daemon, key), f"daemon.{key}")


def group_id(name: str, key: str) -> int | None:
    """The id of the host group `name` that configuration key `key` names (None for ""); a group
    the host lacks is a ConfigError at start, not a socket nobody can reach."""
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(
            f"{key}: no group {name!r} on this host (create it with groupadd, or leave it empty)"
        ) from None


def gateway_address(listen: str) -> tuple[str, int]:
    """(host, port) of rollout.gateway_listen ("127.0.0.1:0", "[::1]:8000")."""
    host, colon, port = listen.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host, int(port)


def _validate_pools(config: Config) -> None:
    pools = config.pools
    if pools.max_starting < 1:
        raise ConfigError("pools.max_starting must be at least 1")
    if not 0 < pools.retry_initial_s <= pools.retry_max_s:
        raise ConfigError("pools.retry_initial_s must be positive and at most pools.retry_max_s")
    names = set()
    for index, entry in enumerate(config.pool):
        if entry.name in names or not entry.name:
            raise ConfigError(f"pool[{index}].name must be unique and non-empty, got {entry.name!r}")
        names.add(entry.name)
        if entry.size < 0:
            raise ConfigError(f"pool[{index}].size must be 0 or more")
        if entry.backend and entry.backend not in BACKENDS:
            raise ConfigError(f"pool[{index}].backend must be one of {', '.join(BACKENDS)}")


def _validate_admission(config: Config) -> None:
    admission, leases = config.admission, config.leases
    if admission.max_starting < 0 or admission.max_creates_per_s < 0 or admission.create_burst < 0:
        raise ConfigError(
            "admission.max_starting, admission.max_creates_per_s and admission.create_burst must be 0 (no cap) or more"
        )
    if leases.max_ttl_s < 1 or leases.idempotency_window_s <= 0:
        raise ConfigError("leases.max_ttl_s must be at least 1 and leases.idempotency_window_s positive")


def _validate_node_protection(config: Config) -> None:
    """The keys that keep sandboxes from starving the node (docs/backends.md, "Node protection")."""
    if config.daemon.memory_overcommit < 0:
        raise ConfigError("daemon.memory_overcommit must be 0 (no admission check) or positive")
    for key, value in (
        ("daemon.oom_score_adj", config.daemon.oom_score_adj),
        ("limits.oom_score_adj", config.limits.oom_score_adj),
    ):
        if not -1000 <= value <= 1000:
            raise ConfigError(f"{key} must be between -1000 and 1000, got {value}")
    for key, value in (
        ("daemon.sandboxes_cpu_weight", config.daemon.sandboxes_cpu_weight),
        ("limits.cpu_weight", config.limits.cpu_weight),
    ):
        if not 0 <= value <= 10_000:
            raise ConfigError(f"{key} must be between 1 and 10000 (0: the kernel's default), got {value}")
