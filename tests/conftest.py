"""Shared fixtures: a real daemon process on a temporary socket, and backend requirements.

Backend-specific tests skip when the backend is missing on this machine, unless the environment
variable CORRAL_REQUIRE_BACKENDS (e.g. "local,docker,podman,singularity") names it: then they
fail, so CI cannot pass by skipping. "podman" is the docker backend talking to Podman's
Docker-compatible socket.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from corral.daemon.cgroups import CgroupDriver
from corral.daemon.commands import DEFAULT_PATH
from corral.daemon.config import load_config
from corral.daemon.doctor import probe
from corral.rollout.coding_clis.install import default_prefix as default_coding_clis_prefix
from corral.v1 import shell_pb2, shell_pb2_grpc

pytest_plugins = ["tests.timing"]

REQUIRED = {b.strip() for b in os.environ.get("CORRAL_REQUIRE_BACKENDS", "").split(",") if b.strip()}
REQUIRED_TRAINERS = {t.strip() for t in os.environ.get("CORRAL_REQUIRE_TRAINERS", "").split(",") if t.strip()}
REQUIRED_HARNESSES = {h.strip() for h in os.environ.get("CORRAL_REQUIRE_HARNESSES", "").split(",") if h.strip()}
REQUIRED_CLUSTERS = {c.strip() for c in os.environ.get("CORRAL_REQUIRE_CLUSTERS", "").split(",") if c.strip()}
REQUIRED_CODING_CLIS = {c.strip() for c in os.environ.get("CORRAL_REQUIRE_CODING_CLIS", "").split(",") if c.strip()}
# Where the coding CLIs are installed (npm --prefix; `python -m corral.rollout.coding_clis install`):
# $CORRAL_CODING_CLIS, else /opt/corral-clis.
CODING_CLIS_PREFIX = default_coding_clis_prefix()


def require_trainer(name: str, module: str, extra: str) -> None:
    """Skips (or, when CORRAL_REQUIRE_TRAINERS names the trainer, fails) if its package is not
    installed: the adapter tests run against the real trainer packages (extras verl, tunix).
    Call it at the top of a test module, before importing the adapter."""
    _require_package("CORRAL_REQUIRE_TRAINERS", REQUIRED_TRAINERS, name, module, extra)


def require_harness(name: str, module: str, extra: str) -> None:
    """require_trainer's twin for the agent harnesses of corral.integrations (extra minisweagent),
    required by CORRAL_REQUIRE_HARNESSES."""
    _require_package("CORRAL_REQUIRE_HARNESSES", REQUIRED_HARNESSES, name, module, extra)


def require_cluster(name: str, module: str, extra: str) -> None:
    """require_trainer's twin for the cluster engines corral.cluster runs on (extra ray), required
    by CORRAL_REQUIRE_CLUSTERS."""
    _require_package("CORRAL_REQUIRE_CLUSTERS", REQUIRED_CLUSTERS, name, module, extra)


def require_coding_cli(name: str) -> str:
    """The path of the coding CLI `name`'s binary under CODING_CLIS_PREFIX; skips (or, when
    CORRAL_REQUIRE_CODING_CLIS names it, fails) when it is not installed there."""
    from corral.rollout.coding_clis import coding_cli

    path = coding_cli(name).binary_path(CODING_CLIS_PREFIX)
    if os.access(path, os.X_OK):
        return path
    reason = f"coding CLI {name} is not installed at {path} (python -m corral.rollout.coding_clis install)"
    if name in REQUIRED_CODING_CLIS:
        pytest.fail(f"{reason} (CORRAL_REQUIRE_CODING_CLIS={os.environ['CORRAL_REQUIRE_CODING_CLIS']})", pytrace=False)
    pytest.skip(reason)


def _require_package(variable: str, required: set[str], name: str, module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return
    reason = f"{name} is not installed (pip install 'corral[{extra}]')"
    if name in required:
        pytest.fail(f"{reason} ({variable}={os.environ[variable]})", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


DOCKER_TEST_IMAGE = os.environ.get("CORRAL_TEST_DOCKER_IMAGE", "corral-test/python:bookworm")
SIF_TEST_IMAGE = os.environ.get("CORRAL_TEST_SIF_IMAGE", "/var/cache/corral-test-images/python-bookworm.sif")
PODMAN_SOCKET = os.environ.get("CORRAL_TEST_PODMAN_SOCKET", "unix:///run/podman/podman.sock")
# The SWE-bench-style image (scripts/build_swe_test_image.sh): in the engines, exported as a root
# filesystem for the local backend, and as a sandbox directory for Apptainer;
# examples/swe/instances.jsonl describes it.
SWE_DOCKER_IMAGE = os.environ.get("CORRAL_TEST_SWE_IMAGE", "corral-test/swe-textkit:bookworm")
SWE_ROOTFS_IMAGE = os.environ.get("CORRAL_TEST_SWE_ROOTFS", "/var/cache/corral-test-images/swe-textkit-bookworm-rootfs")
SWE_APPTAINER_IMAGE = os.environ.get(
    "CORRAL_TEST_SWE_APPTAINER", "/var/cache/corral-test-images/swe-textkit-bookworm-apptainer"
)
# Podman raises nofile and nproc to 1048576 unless told otherwise, which root inside a user
# namespace (these CI machines) may not do: explicit limits within this process's own (the
# service is started alike), which also exercise `docker.ulimits`.
PODMAN_ULIMITS = (f"nofile={min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 65536)}", "nproc=8192")
# (A TOML array of strings is written like a JSON one.)
PODMAN_CONFIG = f'[docker]\nsocket = "{PODMAN_SOCKET}"\nulimits = {json.dumps(list(PODMAN_ULIMITS))}\n'

# Container backends whose sandboxes run as the image's user, root for the test images, by default,
# with Docker's capabilities (docs/backends.md, "Users inside"); local sandboxes are root in a user
# namespace of their own (docs/local-backend.md).
ROOT_INSIDE = {"docker", "singularity"}


# What a test of a root daemon says to an ordinary user, whose daemon would run the local and
# singularity backends rootless (other semantics: one id inside, no cgroups, no id blocks).
ROOTLESS_HERE = (
    "the tests of a root daemon's backends need root; as an ordinary user the local and singularity "
    "backends run rootless, which tests/integration/test_rootless*.py cover (sudo make test runs the rest)"
)


def require_backend(name: str) -> None:
    """Skips (or, when CORRAL_REQUIRE_BACKENDS names the backend, fails) if it is unavailable.
    `name` is a backend, or "podman" for the docker backend on Podman's socket."""
    if name in ("local", "singularity") and os.geteuid() != 0:
        if name in REQUIRED:
            pytest.fail(f"{ROOTLESS_HERE} (CORRAL_REQUIRE_BACKENDS={os.environ['CORRAL_REQUIRE_BACKENDS']})")
        pytest.skip(ROOTLESS_HERE)
    config = load_config(environ={})
    if name == "podman":
        config.backend("docker").socket = PODMAN_SOCKET
    _, statuses = probe(config)
    status = statuses.get("docker" if name == "podman" else name)
    if status and status.available:
        return
    reason = f"backend {name} unavailable: {status.detail if status else 'unknown backend'}"
    if name in REQUIRED:
        pytest.fail(f"{reason} (CORRAL_REQUIRE_BACKENDS={os.environ['CORRAL_REQUIRE_BACKENDS']})")
    pytest.skip(reason)


def require_kernel_python(backend: str) -> None:
    """Skips (or, when CORRAL_REQUIRE_BACKENDS names local, fails) when local "host" sandboxes
    cannot start kernels: they run the host's own python3 (the first on the sandbox's PATH), which
    then needs ipykernel. Container images carry their own."""
    if backend != "local":
        return
    python = shutil.which("python3", path=DEFAULT_PATH)
    if python and subprocess.run([python, "-c", "import ipykernel"], capture_output=True).returncode == 0:
        return
    reason = (
        f"{python or 'python3'} has no ipykernel, and local sandboxes run kernels with the host's python3: "
        "apt-get install python3-ipykernel (make test installs it when run as root)"
    )
    if "local" in REQUIRED:
        pytest.fail(f"{reason} (CORRAL_REQUIRE_BACKENDS={os.environ['CORRAL_REQUIRE_BACKENDS']})")
    pytest.skip(reason)


@pytest.fixture
def kernel_python(request) -> None:
    """For tests that start kernels: see require_kernel_python (the backend is the conformance
    case's, else local)."""
    backend = request.getfixturevalue("daemon").backend if "daemon" in request.fixturenames else "local"
    require_kernel_python(backend)


class DaemonProcess:
    """`corral serve` in a child process, with its own socket and state directory."""

    def __init__(
        self,
        root: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
        python: str = sys.executable,
    ) -> None:
        """`prefix`: what the daemon's command line is run under (another user's identity, say),
        exec'ing it so that the daemon keeps the pid started; `python`: its interpreter."""
        self.root = root
        self.prefix = tuple(prefix)
        self.python = python
        self.socket = root / "corral.sock"
        self.state_dir = root / "state"
        self.address = f"unix://{self.socket}"
        self.extra = extra
        self.env = {**os.environ, **(env or {})}
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen | None = None
        self.backend = "local"  # the backend case a shared fixture started it for (the fixtures set it)

    def start(self, timeout: float = 20.0) -> DaemonProcess:
        cmd = [
            *self.prefix,
            self.python,
            "-m",
            "corral.cli",
            "serve",
            "--socket",
            str(self.socket),
            "--state-dir",
            str(self.state_dir),
            *self.extra,
        ]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if self.serving():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not become ready:\n{self.log.read_text()}")

    def serving(self) -> bool:
        if not self.socket.exists():
            return False
        with grpc.insecure_channel(f"unix:{self.socket}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


# Every test that uses the `daemon` fixture (and so `client` and `sandbox`) runs once per case:
# the conformance suite. A case is a requirement name (see `require_backend`), the backend the
# daemon runs it on (and, for local, a launcher) and its configuration with the test image.
BACKEND_CASES = {
    "local-bwrap": ("local", "local", '[local]\nisolation = "bwrap"\n'),
    "local-unshare": ("local", "local", '[local]\nisolation = "unshare"\n'),
    "docker": (
        "docker",
        "docker",
        f'[daemon]\ndefault_backend = "docker"\n[docker]\ndefault_image = "{DOCKER_TEST_IMAGE}"\n',
    ),
    "podman": (
        "podman",
        "docker",
        f'[daemon]\ndefault_backend = "docker"\n{PODMAN_CONFIG}default_image = "{DOCKER_TEST_IMAGE}"\n',
    ),
    "singularity": (
        "singularity",
        "singularity",
        f'[daemon]\ndefault_backend = "singularity"\n[singularity]\ndefault_image = "{SIF_TEST_IMAGE}"\n',
    ),
}


# The shared daemons hold many short-lived sandboxes at the default memory limit (4 GiB): whether
# the node admits them would depend on the memory of the machine running the suite, so memory
# admission (tests/integration/test_node_protection.py) is off in them.
SHARED_DAEMON_SETTINGS = "memory_overcommit = 0.0\n"


def shared_daemon_config(case_config: str) -> str:
    """A shared daemon's corral.toml: the case's, with SHARED_DAEMON_SETTINGS in its [daemon]."""
    if "[daemon]\n" in case_config:
        return case_config.replace("[daemon]\n", "[daemon]\n" + SHARED_DAEMON_SETTINGS, 1)
    return "[daemon]\n" + SHARED_DAEMON_SETTINGS + case_config


def require_image(
    name: str,
    *,
    docker_image: str = DOCKER_TEST_IMAGE,
    singularity_image: str = SIF_TEST_IMAGE,
    local_image: str | None = None,
) -> None:
    """The test image a backend case needs (scripts/build_test_images.sh builds them); `name` as
    for `require_backend`. The local backend needs none unless `local_image` names one."""
    if name in ("docker", "podman"):
        engine = [name] if name == "docker" else ["podman", "--url", PODMAN_SOCKET]
        found = subprocess.run([*engine, "image", "inspect", docker_image], capture_output=True).returncode == 0
        image = docker_image
    elif name == "singularity":
        found, image = os.path.exists(singularity_image), singularity_image
    elif local_image is not None:
        found, image = os.path.isdir(local_image), local_image
    else:
        return
    if not found:
        reason = f"{name} test image {image} is missing: run scripts/build_test_images.sh"
        if name in REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)


# Which backend cases a test that takes `daemon` runs on (tests/README.md states the rule): every
# case by default, the conformance core; one case for a test of logic above the backend (marker
# `above_backend`); one local and one engine case for a load test (marker `load`).
EVERY_CASE = tuple(BACKEND_CASES)
ONE_CASE = ("local-bwrap",)
LOAD_CASES = ("local-bwrap", "docker")


def backend_cases_of(definition: pytest.Function) -> tuple[str, ...]:
    if definition.get_closest_marker("above_backend"):
        return ONE_CASE
    if definition.get_closest_marker("load"):
        return LOAD_CASES
    return EVERY_CASE


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    definitions = metafunc._arg2fixturedefs.get("daemon", ())
    # (Only where `daemon` is this module's: a test module may define a `daemon` of its own.)
    if definitions and definitions[-1].func.__module__ == __name__:
        metafunc.parametrize("daemon", backend_cases_of(metafunc.definition), indirect=True, scope="session")


@pytest.fixture(scope="session")
def daemon(request, tmp_path_factory) -> Iterator[DaemonProcess]:
    """One daemon per backend case for the whole session (tests that kill or restart daemons make
    their own). Sandboxes created without an image get the case's test image. Its cases come from
    pytest_generate_tests."""
    requirement, backend, config_text = BACKEND_CASES[request.param]
    require_backend(requirement)
    require_image(requirement)
    root = tmp_path_factory.mktemp(f"daemon-{request.param}")
    config = root / "corral.toml"
    config.write_text(shared_daemon_config(config_text))
    proc = DaemonProcess(root, "--config", str(config)).start()
    proc.backend = backend
    yield proc
    proc.stop()


@pytest.fixture
def swe_image(request, daemon) -> str:
    """The SWE-bench-style image as the conformance case's backend names it (required like the
    case's own test image)."""
    requirement = BACKEND_CASES[request.node.callspec.params["daemon"]][0]
    require_image(
        requirement, docker_image=SWE_DOCKER_IMAGE, singularity_image=SWE_APPTAINER_IMAGE, local_image=SWE_ROOTFS_IMAGE
    )
    return {"docker": SWE_DOCKER_IMAGE, "podman": SWE_DOCKER_IMAGE, "singularity": SWE_APPTAINER_IMAGE}.get(
        requirement, SWE_ROOTFS_IMAGE
    )


@pytest.fixture(scope="session")
def local_daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    """One daemon on the local backend for tests that are about something other than backends
    (rollouts, adapters): they run once, not once per backend case."""
    require_backend("local")
    root = tmp_path_factory.mktemp("daemon-local")
    config = root / "corral.toml"
    # Rollouts wait 2 s, not a minute, for a down LLM server to come back: tests of a server that
    # is down stay short. Harness tasks may run on the node (tests/integration/test_harness_tasks.py).
    config.write_text(shared_daemon_config("[rollout]\nllm_unavailable_wait_s = 2\nallow_host_harness = true\n"))
    proc = DaemonProcess(root, "--config", str(config)).start()
    proc.backend = "local"
    yield proc
    proc.stop()


@pytest.fixture
def backend(daemon) -> str:
    """The backend the current conformance case runs on."""
    return daemon.backend


@pytest.fixture
def client(daemon):
    from corral.sdk import Client

    with Client(daemon.address) as c:
        yield c


@pytest.fixture
def sandbox(client):
    with client.create_sandbox() as sb:
        yield sb


# What a test that crashes or stops daemons checks: only that daemon's own cgroups and processes.


def cgroup_dirs(daemon_id: str) -> list[Path]:
    """The sandbox cgroups left under that daemon's own base directories (only those: other
    daemons on this machine come and go meanwhile). The daemons here are children of this process,
    so their bases sit under this process's cgroups: beside them, or, on cgroup v2 where a daemon
    moved its whole cgroup (this process included) into a `daemon` leaf, beside that leaf."""
    found = []
    for h in CgroupDriver(daemon_id, create=False).hierarchies:
        for base in (h.base, h.base.parent.parent / h.base.name):
            if base.is_dir():
                found += [p for p in base.iterdir() if p.is_dir()]
                break
    return found


def sandbox_pids(daemon_id: str) -> set[int]:
    """The host pids of every process in that daemon's sandboxes (their cgroups, leaves included)."""
    pids: set[int] = set()
    for group in cgroup_dirs(daemon_id):
        for procs in group.rglob("cgroup.procs"):
            pids |= {int(pid) for pid in procs.read_text().split()}
    return pids


def alive_pids(pids: set[int]) -> set[int]:
    """Those of `pids` still running (a zombie counts as gone)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.add(pid)
    return alive


# ShellService through the generated stubs (tests/integration/test_shells.py and the fidelity tests).


@pytest.fixture
def shells(daemon):
    """A ShellService stub on the conformance case's daemon."""
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        yield shell_pb2_grpc.ShellServiceStub(channel)


class Session:
    def __init__(self, stub, sandbox_id: str, name: str = "main") -> None:
        self.stub, self.sandbox_id, self.name = stub, sandbox_id, name
        stub.OpenShell(shell_pb2.OpenShellRequest(sandbox_id=sandbox_id, name=name), timeout=30)

    def run(self, command: str, timeout: float = 20, **kw) -> shell_pb2.RunInShellResponse:
        return self.stub.RunInShell(
            shell_pb2.RunInShellRequest(
                sandbox_id=self.sandbox_id, name=self.name, command=command, timeout_ms=int(timeout * 1000), **kw
            ),
            timeout=timeout + 20,
        )
