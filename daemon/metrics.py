"""Prometheus metrics of one daemon, in a registry of its own (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.sandboxes_live = Gauge("corral_sandboxes_live", "Sandboxes alive now", registry=self.registry)
        self.sandboxes_created = Counter(
            "corral_sandboxes_created", "Sandboxes created", ["backend"], registry=self.registry
        )
        self.execs = Counter(
            "corral_execs", "Commands started (Exec and ExecStream)", ["backend"], registry=self.registry
        )
        self.exec_timeouts = Counter(
            "corral_exec_timeouts", "Commands killed by their timeout", ["backend"], registry=self.registry
        )
        self.rpc_seconds = Histogram(
            "corral_rpc_seconds",
            "RPC handling time",
            ["method", "code"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )

    def serve_http(self, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
