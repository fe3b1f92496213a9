"""What every benchmark shares: a throwaway daemon, timing, the results table and the JSON file.

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
from datetime import datetime, timezone
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


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

    def __init__(self, *, tcp: bool = False) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="corral-bench-"))
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
        cmd = [sys.executable, "-m", "corral.sdk.cli", "serve", "--socket", str(self.socket),
               "--state-dir", str(self.root / "state")]
        if self.tcp_address:
            token_file = self.root / "token"
            token_file.write_text(self.token)
            cmd += ["--tcp", self.tcp_address, "--token-file", str(token_file)]
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


def time_calls(fn: Callable[[], object], n: int) -> list[float]:
    """Milliseconds of each of `n` calls of `fn`."""
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def interleaved(variants: dict[str, Callable[[], object]], n: int, warmup: int, *,
                counts: dict[str, int] | None = None, blocks: int = 20) -> dict[str, list[float]]:
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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(samples: list[float]) -> dict:
    return {"p50_ms": round(percentile(samples, 50), 4), "p99_ms": round(percentile(samples, 99), 4),
            "n": len(samples)}


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
    print(f"{title}\n  {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.uname().nodename}, {os.cpu_count()} CPUs, "
          f"load average {load}, Python {sys.version.split()[0]}, grpcio {grpc.__version__}")


def write_json(path: str | None, results: dict, ratio_values: dict) -> None:
    """Writes {"results": {name: {"p50_ms", "p99_ms", "n", ...}}, "ratios": {"a/b": x}}."""
    if not path:
        return
    Path(path).write_text(json.dumps({"results": results, "ratios": ratio_values}, indent=2) + "\n")
    print(f"\nwrote {path}")
