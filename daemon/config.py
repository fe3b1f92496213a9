"""Daemon configuration: a TOML file, then environment variables, then command-line flags.

deploy/corral.toml documents every key with its default; `Config` mirrors it section by section.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_SOCKET = "/run/corral/corral.sock"
DEFAULT_STATE_DIR = "/var/lib/corral"


@dataclass
class TcpConfig:
    listen: str = ""
    token_file: str = ""


@dataclass
class DaemonConfig:
    socket: str = DEFAULT_SOCKET
    socket_mode: str = "0660"
    state_dir: str = DEFAULT_STATE_DIR
    grace_period_s: float = 10.0
    default_backend: str = "local"
    max_sandboxes: int = 1000
    tcp: TcpConfig = field(default_factory=TcpConfig)


@dataclass
class MetricsConfig:
    listen: str = ""


@dataclass
class ExecConfig:
    default_timeout_s: float = 600.0
    max_timeout_s: float = 86400.0
    default_output_limit_bytes: int = 1 << 20
    max_output_limit_bytes: int = 64 << 20
    max_file_bytes: int = 64 << 20


@dataclass
class LocalConfig:
    isolation: str = "auto"  # auto | bwrap | unshare | none
    allow_no_isolation: bool = False
    uid_base: int = 1_500_000
    uid_count: int = 65536
    workdir: str = "/workspace"


@dataclass
class DockerConfig:
    socket: str = ""  # empty: $DOCKER_HOST, else unix:///var/run/docker.sock
    pull: bool = False  # pull images missing locally (no registry is assumed by default)
    default_image: str = ""  # the image of requests that name none
    # Process rlimits for every container, "name=soft[:hard]" (e.g. "nofile=65536"); empty: the
    # engine's defaults. Podman sets nofile and nproc to 1048576 unless told otherwise, which
    # fails where root cannot raise rlimits that far (e.g. inside a user namespace).
    ulimits: list[str] = field(default_factory=list)


@dataclass
class SingularityConfig:
    default_image: str = ""  # absolute path of the SIF file or sandbox directory for requests naming none


@dataclass
class LimitsConfig:
    memory_bytes: int = 4 << 30
    pids: int = 1024
    cpu_millicores: int = 0
    idle_timeout_s: float = 0.0


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
    # One LLM request: its timeout and how many servers to try before the rollout is filtered.
    llm_timeout_s: float = 600.0
    llm_attempts: int = 3


@dataclass
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    exec: ExecConfig = field(default_factory=ExecConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    docker: DockerConfig = field(default_factory=DockerConfig)
    singularity: SingularityConfig = field(default_factory=SingularityConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # The bearer token for the TCP listener (from token_file or CORRAL_TOKEN); never from TOML text.
    token: str = ""

    @property
    def state_path(self) -> Path:
        return Path(self.daemon.state_dir)


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


def _merge(target: Any, values: dict[str, Any], where: str) -> None:
    known = {f.name: f for f in dataclasses.fields(target)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown configuration key {where}{key}")
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{key} must be a table")
            _merge(current, value, f"{where}{key}.")
        elif not _same_kind(current, value):
            raise ConfigError(
                f"{where}{key} must be {type(current).__name__}, got {type(value).__name__}"
            )
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
                _merge(config, tomllib.load(fh), "")
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"cannot read configuration {path}: {err}") from err
    config.daemon.socket = socket or env.get("CORRAL_SOCKET") or config.daemon.socket
    config.daemon.state_dir = state_dir or env.get("CORRAL_STATE_DIR") or config.daemon.state_dir
    if tcp_listen is not None:
        config.daemon.tcp.listen = tcp_listen
    if token_file is not None:
        config.daemon.tcp.token_file = token_file
    if metrics_listen is not None:
        config.metrics.listen = metrics_listen
    if config.daemon.tcp.token_file:
        try:
            config.token = Path(config.daemon.tcp.token_file).read_text().strip()
        except OSError as err:
            raise ConfigError(f"cannot read token file {config.daemon.tcp.token_file}: {err}") from err
    config.token = config.token or env.get("CORRAL_TOKEN", "")
    validate(config)
    return config


def parse_ulimit(entry: str) -> tuple[str, int, int]:
    """"name=soft[:hard]" -> (name, soft, hard); hard defaults to soft."""
    name, sep, values = entry.partition("=")
    soft, _, hard = values.partition(":")
    try:
        if not (sep and name.strip() and soft):
            raise ValueError
        parsed = (name.strip(), int(soft), int(hard or soft))
    except ValueError:
        raise ConfigError(f'docker.ulimits entry {entry!r} is not "name=soft[:hard]" (e.g. "nofile=65536:65536")') from None
    if parsed[1] > parsed[2]:
        raise ConfigError(f"docker.ulimits entry {entry!r}: the soft limit exceeds the hard one")
    return parsed


def validate(config: Config) -> None:
    if config.daemon.tcp.listen and not config.token:
        raise ConfigError(
            "daemon.tcp.listen is set but no bearer token is configured: set daemon.tcp.token_file "
            "or CORRAL_TOKEN (the TCP listener never starts without one)"
        )
    if config.local.isolation not in ("auto", "bwrap", "unshare", "none"):
        raise ConfigError("local.isolation must be one of auto, bwrap, unshare, none")
    if config.local.isolation == "none" and not config.local.allow_no_isolation:
        raise ConfigError('local.isolation = "none" requires local.allow_no_isolation = true')
    for entry in config.docker.ulimits:
        parse_ulimit(entry)
    if config.daemon.default_backend not in ("local", "docker", "singularity"):
        raise ConfigError("daemon.default_backend must be one of local, docker, singularity")
    for stage in ("init", "run", "eval"):
        if getattr(config.rollout, f"{stage}_workers") < 1:
            raise ConfigError(f"rollout.{stage}_workers must be at least 1")
    try:
        int(config.daemon.socket_mode, 8)
    except ValueError as err:
        raise ConfigError("daemon.socket_mode must be an octal string such as \"0660\"") from err
