"""What every benchmark shares: a throwaway daemon, timing, the results table and the JSON file,
and the container backends' test images and raw engines.

Percentiles use linear interpolation between the closest ranks (numpy's default), so p99 of a
short run is not just its maximum.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from corral.sdk.enums import BACKEND_NAMES


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a short run (a few seconds)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    if extra:
        extra(parser)
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """`corral serve` on a temporary socket (and, with `tcp=True`, 127.0.0.1 with a token), in a
    temporary directory that is removed on stop."""

    def __init__(self, *, tcp: bool = False, config: str = "") -> None:
        self.root = Path(tempfile.mkdtemp(prefix="corral-bench-"))
        self.config = config  # corral.toml text, if any
        self.socket = self.root / "corral.sock"
        self.address = f"unix://{self.socket}"
        self.token = secrets.token_hex(16) if tcp else None
        self.tcp_address = f"127.0.0.1:{free_port()}" if tcp else None
        self.log = self.root / "daemon.log"
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> Daemon:
        cmd = [
            *self.command(),
            "--socket",
            str(self.socket),
            "--state-dir",
            str(self.root / "state"),
        ]
        if self.tcp_address:
            assert self.token is not None  # made with the TCP address (tcp=True)
            token_file = self.root / "token"
            token_file.write_text(self.token)
            cmd += ["--tcp", self.tcp_address, "--token-file", str(token_file)]
        if self.config:
            (self.root / "corral.toml").write_text(self.config)
            cmd += ["--config", str(self.root / "corral.toml")]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if self._serving():
                return self
            time.sleep(0.05)
        raise RuntimeError("daemon did not become ready")

    def command(self) -> list[str]:
        """The command line that serves, before its options (another user's, in a subclass)."""
        return [sys.executable, "-m", "corral.cli", "serve"]

    def _serving(self) -> bool:
        if not self.socket.exists():
            return False
        with grpc.insecure_channel(f"unix:{self.socket}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Daemon:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


# The test images of scripts/build_test_images.sh, as the test suite names them.
DOCKER_IMAGE = os.environ.get("CORRAL_TEST_DOCKER_IMAGE", "corral-test/python:bookworm")
SIF_IMAGE = os.environ.get("CORRAL_TEST_SIF_IMAGE", "/var/cache/corral-test-images/python-bookworm.sif")
# What the benchmarks measure: every backend of the contract (corral.sdk.enums), and after docker
# "podman", the docker backend on Podman's Docker-compatible socket (a daemon of its own).
BACKENDS = list(BACKEND_NAMES)
BACKENDS.insert(BACKENDS.index("docker") + 1, "podman")
# The test image each runs; a backend without one here is skipped (backend_missing).
BACKEND_IMAGES = {"local": "host", "docker": DOCKER_IMAGE, "podman": DOCKER_IMAGE, "singularity": SIF_IMAGE}
# The SWE-bench-style test image (scripts/build_swe_test_image.sh) as each backend runs it.
SWE_DOCKER_IMAGE = os.environ.get("CORRAL_TEST_SWE_IMAGE", "corral-test/swe-textkit:bookworm")
SWE_IMAGES = {
    "local": os.environ.get("CORRAL_TEST_SWE_ROOTFS", "/var/cache/corral-test-images/swe-textkit-bookworm-rootfs"),
    "docker": SWE_DOCKER_IMAGE,
    "podman": SWE_DOCKER_IMAGE,
    "singularity": os.environ.get(
        "CORRAL_TEST_SWE_APPTAINER", "/var/cache/corral-test-images/swe-textkit-bookworm-apptainer"
    ),
}
PODMAN_SOCKET = os.environ.get("CORRAL_TEST_PODMAN_SOCKET", "unix:///run/podman/podman.sock")
# Explicit rlimits, as the tests give Podman (tests/conftest.py): its defaults (1048576) cannot be
# set where root lives in a user namespace.
PODMAN_ULIMITS = {"nofile": 4096, "nproc": 8192}
# (A TOML array of strings is written like a JSON one.)
PODMAN_CONFIG = (
    f'[docker]\nsocket = "{PODMAN_SOCKET}"\nulimits = {json.dumps([f"{k}={v}" for k, v in PODMAN_ULIMITS.items()])}\n'
)
# What corral's sandboxes get as their workdir and run directory (daemon/config.py, backends/base.py).
WORKDIR, RUN_DIR_IN_SANDBOX = "/workspace", "/run/corral"
NSENTER_FLAGS = ["-m", "-p", "-i", "-u", "-n", "-r", "-w"]


def apptainer_binary() -> str | None:
    return shutil.which("apptainer") or shutil.which("singularity")


def backend_missing(backend: str) -> str | None:
    """Why `backend` (its test image, its engine) cannot be measured here; None if it can."""
    if backend not in BACKEND_IMAGES:
        return f"no test image for backend {backend!r} in bench/_common.py"
    if os.geteuid() != 0:
        return "needs root (the daemon and the raw engines run as root)"
    if backend == "local":
        return None if shutil.which("bwrap") else "bwrap not installed (apt-get install bubblewrap)"
    if not shutil.which("nsenter"):
        return "nsenter not installed (apt-get install util-linux)"
    if backend in ("docker", "podman"):
        engine = ["docker"] if backend == "docker" else ["podman", "--url", PODMAN_SOCKET]
        if not shutil.which(engine[0]):
            return f"{engine[0]} CLI not installed"
        found = subprocess.run([*engine, "image", "inspect", DOCKER_IMAGE], capture_output=True)
        if found.returncode != 0:
            return f"{backend} image {DOCKER_IMAGE} missing or engine down: run scripts/build_test_images.sh"
        return None
    if backend == "singularity":
        if not apptainer_binary():
            return "neither apptainer nor singularity is installed"
        return None if os.path.exists(SIF_IMAGE) else f"{SIF_IMAGE} missing: run scripts/build_test_images.sh"
    return f"unknown backend {backend!r}"


class ApptainerInstance:
    """An `apptainer instance start` of the test SIF with the daemon's own flags (see
    daemon/backends/singularity/backend.py): --containall --no-home --hostname corral, a workspace and a
    run directory bound as in a corral sandbox, no network. Its binds live in `base` (made here
    if None) so that a benchmark can start many without making directories inside the timing."""

    def __init__(self, name: str, base: Path | None = None, image: str = SIF_IMAGE) -> None:
        binary = apptainer_binary()
        assert binary, "apptainer is not installed"
        self.binary = binary
        self.name, self.image = name, image
        self.own_base = base is None
        self.base = Path(tempfile.mkdtemp(prefix="corral-bench-sif-")) if base is None else base
        for sub in ("workspace", "run"):
            (self.base / sub).mkdir(exist_ok=True)
        self.started = False

    def argv(self) -> list[str]:
        return [
            self.binary,
            "instance",
            "start",
            "--containall",
            "--no-home",
            "--hostname",
            "corral",
            "--bind",
            f"{self.base / 'workspace'}:{WORKDIR}",
            "--bind",
            f"{self.base / 'run'}:{RUN_DIR_IN_SANDBOX}",
            "--net",
            "--network",
            "none",
            self.image,
            self.name,
        ]

    def start(self) -> ApptainerInstance:
        self.started = True
        done = subprocess.run(self.argv(), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"apptainer instance start failed: {done.stdout}{done.stderr}")
        return self

    def pid(self) -> int:
        done = subprocess.run(
            [self.binary, "instance", "list", "--json", self.name], capture_output=True, text=True, check=True
        )
        found = [i for i in json.loads(done.stdout).get("instances") or [] if i.get("instance") == self.name]
        if not found:
            raise RuntimeError(f"instance {self.name} is not listed")
        return int(found[0]["pid"])

    def stop(self) -> None:
        """As the daemon stops its instances: SIGKILL, and apptainer removes its record."""
        if self.started:
            subprocess.run([self.binary, "instance", "stop", "--signal", "SIGKILL", self.name], capture_output=True)
            self.started = False
        if self.own_base:
            shutil.rmtree(self.base, ignore_errors=True)


def docker_container_of(sandbox_id: str) -> tuple[str, int]:
    """The id and init pid of the container of a corral docker sandbox (found by its label)."""
    ids = subprocess.run(
        ["docker", "ps", "-q", "--no-trunc", "--filter", f"label=io.corral.sandbox={sandbox_id}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if len(ids) != 1:
        raise RuntimeError(f"expected one container labelled io.corral.sandbox={sandbox_id}, found {ids}")
    pid = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Pid}}", ids[0]], capture_output=True, text=True, check=True
    ).stdout.strip()
    return ids[0], int(pid)


def time_calls(fn: Callable[[], object], n: int) -> list[float]:
    """Milliseconds of each of `n` calls of `fn`."""
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def interleaved(
    variants: dict[str, Callable[[], object]],
    n: int,
    warmup: int,
    *,
    counts: dict[str, int] | None = None,
    blocks: int = 20,
) -> dict[str, list[float]]:
    """Times every variant `n` times (or `counts[name]` times), in `blocks` alternating blocks so
    that drift in the machine's load hits all of them alike. Each variant is first called
    `warmup` times untimed."""
    counts = {name: (counts or {}).get(name, n) for name in variants}
    for name, fn in variants.items():
        for _ in range(min(warmup, counts[name])):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for block in range(1, blocks + 1):
        for name, fn in variants.items():
            samples[name] += time_calls(fn, counts[name] * block // blocks - len(samples[name]))
    return samples


def interleaved_phases(
    variants: dict[str, Callable[[], dict[str, float]]], n: int, warmup: int, *, blocks: int = 20
) -> dict[str, dict[str, list[float]]]:
    """`interleaved` for calls that time their own phases: each call returns {phase: ms} (say the
    start of a sandbox and, untimed by the caller, its destruction); the result is
    {variant: {phase: [ms, ...]}}. Same warm-up and alternating blocks."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    done = dict.fromkeys(variants, 0)
    for block in range(1, blocks + 1):
        for name, fn in variants.items():
            while done[name] < n * block // blocks:
                for phase, ms in fn().items():
                    samples[name].setdefault(phase, []).append(ms)
                done[name] += 1
    return samples


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(samples: list[float]) -> dict:
    return {"p50_ms": round(percentile(samples, 50), 4), "p99_ms": round(percentile(samples, 99), 4), "n": len(samples)}


def ratios(results: dict[str, dict], pairs: list[tuple[str, str]]) -> dict[str, float]:
    """p50(a) / p50(b) for each pair whose both sides were measured, keyed "a/b"."""
    out = {}
    for a, b in pairs:
        if a in results and b in results and results[b]["p50_ms"] > 0:
            out[f"{a}/{b}"] = round(results[a]["p50_ms"] / results[b]["p50_ms"], 2)
    return out


def print_table(title: str, results: dict[str, dict], skipped: dict[str, str] | None = None) -> None:
    width = max([len(name) for name in [*results, *(skipped or {})]] + [8])
    print(f"\n{title}")
    print(f"  {'variant':<{width}}  {'p50 ms':>9}  {'p99 ms':>9}  {'n':>6}")
    for name, r in results.items():
        print(f"  {name:<{width}}  {r['p50_ms']:>9.3f}  {r['p99_ms']:>9.3f}  {r['n']:>6}")
    for name, reason in (skipped or {}).items():
        print(f"  {name:<{width}}  skipped: {reason}")


def print_ratios(values: dict[str, float]) -> None:
    if values:
        print("  ratios (p50): " + ", ".join(f"{k} = {v:.2f}x" for k, v in values.items()))


def print_header(title: str) -> None:
    """What was measured where: the numbers mean little without the machine and its load."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{title}\n  {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.uname().nodename}, {os.cpu_count()} CPUs, "
        f"load average {load}, Python {sys.version.split()[0]}, grpcio {grpc.__version__}"
    )


def write_json(path: str | None, results: dict, ratio_values: dict, extra: dict | None = None) -> None:
    """Writes {"results": {name: {"p50_ms", "p99_ms", "n", ...}}, "ratios": {"a/b": x}}, plus the
    keys of `extra` (what was measured: a backend, an image)."""
    if not path:
        return
    document = {"results": results, "ratios": ratio_values, **(extra or {})}
    Path(path).write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {path}")
