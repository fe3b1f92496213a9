"""`corral doctor`: what this machine can do, and how to fix what is missing.

Two views: the running daemon's (GetNodeInfo, what it found at start with its own settings), when
one answers, and this host probed here the way a daemon probes it at start, with this command's
settings (which may differ from a running daemon's). Every missing part comes with its fix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from corral.sdk.types import NodeInfo

from .admission import GIB, node_memory_bytes
from .backends import base
from .backends.base import FIX_ROOT, BackendStatus
from .backends.local.images import TOOL_PACKAGES, image_tools
from .backends.registry import BACKENDS
from .cgroups import CgroupDriver, LimitSupport
from .commands import DEFAULT_PATH
from .config import Config
from .node import make_backends

# What doctor says to do about what is missing beside the backends (each backend names the fixes
# for its own: Backend.fixes).
FIX_IPYKERNEL = "apt-get install python3-ipykernel"
FIX_IMAGE_TOOLS = f"apt-get install {' '.join(TOOL_PACKAGES.values())}"
FIX_NO_DAEMON = "start one: `corral serve` (or systemctl start corral), or point --address / $CORRAL_ADDRESS at it"


@dataclass(frozen=True)
class Limit:
    kind: str
    enforced: bool
    mechanism: str
    reason: str
    approximated: bool = False

    @property
    def state(self) -> str:
        """How `corral doctor` says it: enforced, approximated (by what, and why not enforced) or
        not enforced (why)."""
        if self.enforced:
            return f"enforced ({self.mechanism})"
        if self.approximated:
            return f"approximated ({self.mechanism}); not enforced: {self.reason}"
        return f"not enforced: {self.reason}"


@dataclass(frozen=True)
class Backend:
    """One backend's status as either view reports it."""

    name: str
    available: bool
    detail: str
    isolation: str
    limits: tuple[Limit, ...]


def probe(config: Config) -> tuple[str, dict[str, BackendStatus]]:
    """(cgroup mode, status per backend) without creating anything."""
    cgroups = CgroupDriver("doctor", create=False)
    backends = make_backends(config, cgroups, "doctor")
    return cgroups.mode, {name: backend.status() for name, backend in backends.items()}


def host_backends(statuses: dict[str, BackendStatus]) -> list[Backend]:
    return [
        Backend(
            name,
            status.available,
            status.detail,
            status.isolation,
            tuple(
                Limit(kind, limit.enforced, limit.mechanism, limit.reason, limit.approximated)
                for kind, limit in status.limits.items()
            ),
        )
        for name, status in statuses.items()
    ]


def daemon_backends(node: NodeInfo) -> list[Backend]:
    return [
        Backend(
            status.backend,
            status.available,
            status.detail,
            status.isolation,
            tuple(
                Limit(limit.kind, limit.enforced, limit.mechanism, limit.reason, limit.approximated)
                for limit in status.limits
            ),
        )
        for status in node.backends
    ]


def fixes(backend: Backend) -> list[str]:
    """What to do about the parts of a backend that are missing or second best: its class's
    `fixes` (one this corral does not know, from a newer daemon, gets those every backend shares)."""
    limits = {
        limit.kind: LimitSupport(limit.enforced, limit.mechanism, limit.reason, limit.approximated)
        for limit in backend.limits
    }
    status = BackendStatus(backend.available, backend.detail, backend.isolation, limits)
    return BACKENDS.get(backend.name, base.Backend).fixes(status)


def backend_lines(backends: Iterable[Backend], indent: str = "") -> list[str]:
    lines = []
    for backend in backends:
        lines.append(
            f"{indent}{backend.name}: {'available' if backend.available else 'unavailable'} - {backend.detail}"
        )
        if backend.available:  # (an unavailable backend enforces nothing: its limits would mislead)
            lines.append(f"{indent}  isolation: {backend.isolation}")
            lines += [f"{indent}  {limit.kind}: {limit.state}" for limit in backend.limits]
        lines += [f"{indent}  fix: {fix}" for fix in fixes(backend)]
    return lines


def kernel_python(path: str = DEFAULT_PATH) -> tuple[bool, str]:
    """Whether local "host" sandboxes can start IPython kernels: they run the host's python3 (the
    first on the sandboxes' PATH), which needs ipykernel. (ok, what was found)."""
    python = shutil.which("python3", path=path)
    if python is None:
        return False, f"no python3 on the sandboxes' PATH ({path})"
    try:
        found = subprocess.run(
            [python, "-c", "import ipykernel; print(ipykernel.__version__)"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as err:
        return False, f"{python} does not run: {err}"
    if found.returncode != 0:
        return False, f"{python} has no ipykernel"
    return True, f"{python} has ipykernel {found.stdout.strip()}"


def daemon_section(address: str, node: NodeInfo | None, error: str | None, fix: str | None = None) -> list[str]:
    """`fix`: what to do when none answers, where the error says (else: start one)."""
    if node is None:
        return [f"daemon at {address}: none answers ({error})", f"  fix: {fix or FIX_NO_DAEMON}"]
    return [
        f"daemon at {address}: corral {node.version}, id {node.daemon_id}, {node.sandbox_count} sandboxes, "
        f"default backend {node.default_backend}, cgroups {node.cgroup_mode}",
        *backend_lines(daemon_backends(node), indent="  "),
    ]


def host_section(
    config: Config, config_source: str, probed: tuple[str, dict[str, BackendStatus]] | None = None
) -> list[str]:
    """This host, probed with `config` (or as `probed` already found it)."""
    mode, statuses = probed or probe(config)
    root = os.geteuid() == 0
    lines = [
        f"this host, probed by corral doctor ({config_source}; a daemon started with other settings may differ):",
        f"  cgroups: {mode}" + ("" if root else " (not root: cgroups and per-sandbox uids unavailable)"),
    ]
    if not root:
        lines.append(f"  fix: {FIX_ROOT}")
    lines += backend_lines(host_backends(statuses), indent="  ")
    lines += protection_lines(config, has_capability(CAP_SYS_RESOURCE))
    ok, found = image_tools()
    lines.append(f"  container images in local sandboxes: {'ok' if ok else 'unavailable'} - {found}")
    if not ok:
        lines.append(f"    fix: {FIX_IMAGE_TOOLS}")
    ok, found = kernel_python()
    lines.append(f"  kernels in local host-image sandboxes: {'ok' if ok else 'unavailable'} - {found}")
    if not ok:
        lines.append(f"    fix: {FIX_IPYKERNEL}")
    return lines


CAP_SYS_RESOURCE = 24  # linux/capability.h


def has_capability(bit: int, status: str = "/proc/self/status") -> bool:
    """Whether this process holds a capability (its CapEff), as a daemon started here would."""
    with open(status) as fh:
        for line in fh:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def protection_lines(config: Config, may_lower_oom_score: bool) -> list[str]:
    """What keeps sandboxes from starving this node, with these settings (docs/backends.md,
    "Node protection")."""
    daemon, limits = config.daemon, config.limits
    if daemon.memory_overcommit:
        node = node_memory_bytes()
        admission = (
            f"sandboxes' memory limits admitted up to {daemon.memory_overcommit:g} x {node / GIB:.1f} GiB "
            f"= {daemon.memory_overcommit * node / GIB:.1f} GiB (daemon.memory_overcommit)"
        )
    else:
        admission = "no memory admission (daemon.memory_overcommit = 0)"
    daemon_score = str(daemon.oom_score_adj)
    if daemon.oom_score_adj < 0 and not may_lower_oom_score:
        daemon_score += " wanted, left at its inherited score here (no CAP_SYS_RESOURCE)"
    return [
        f"  node protection: {admission}",
        f"    oom_score_adj: daemon {daemon_score}; sandbox processes {limits.oom_score_adj}",
        f"    cpu weight: all sandboxes {daemon.sandboxes_cpu_weight or 'kernel default'}, "
        f"each sandbox {limits.cpu_weight or 'kernel default'} (the node's other work: 100)",
    ]


@dataclass(frozen=True)
class Report:
    text: str
    # Some backend can make a sandbox: the running daemon's, or where none answers, this host's
    # as probed (doctor exits non-zero otherwise).
    usable: bool


NOTHING_USABLE = "no backend can make a sandbox here: see each backend's fix above"


def report(
    config: Config,
    *,
    address: str,
    node: NodeInfo | None,
    error: str | None = None,
    fix: str | None = None,
    config_source: str = "default settings",
) -> Report:
    """The daemon's view (`node`, from GetNodeInfo at `address`; None when none answered, with
    `error` and, when known, its `fix`), then this host's."""
    probed = probe(config)
    sections: Sequence[list[str]] = (
        daemon_section(address, node, error, fix),
        host_section(config, config_source, probed),
    )
    if node is not None:
        usable = any(status.available for status in node.backends)
    else:
        usable = any(status.available for status in probed[1].values())
    return Report("\n".join(line for section in sections for line in section), usable)
