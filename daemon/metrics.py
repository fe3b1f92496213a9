"""Prometheus metrics of one daemon, in a registry of its own (no process-global state)."""

from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from corral.rollout.gateway import GatewayCounters


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
        self.pool_depth = Gauge(
            "corral_pool_depth", "Ready sandboxes in each warm pool", ["pool"], registry=self.registry
        )
        self.pool_starting = Gauge(
            "corral_pool_starting", "Warm-pool sandboxes being started now (all pools)", registry=self.registry
        )
        self.pool_hits = Counter(
            "corral_pool_hits", "CreateSandbox requests served from a warm pool", ["pool"], registry=self.registry
        )
        self.pool_misses = Counter(
            "corral_pool_misses",
            'CreateSandbox requests started cold: their pool was empty, or "none" matched',
            ["pool"],
            registry=self.registry,
        )
        self.pool_refill_seconds = Histogram(
            "corral_pool_refill_seconds",
            "Time to start one warm-pool sandbox",
            ["pool"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.pool_start_failures = Counter(
            "corral_pool_start_failures", "Warm-pool sandboxes that failed to start", ["pool"], registry=self.registry
        )
        self.leases_expired = Counter(
            "corral_leases_expired", "Sandboxes destroyed because their lease expired", registry=self.registry
        )
        self.idempotent_hits = Counter(
            "corral_idempotent_hits",
            "CreateSandbox requests answered with the sandbox of their idempotency key",
            registry=self.registry,
        )
        self.admission_refusals = Counter(
            "corral_admission_refusals",
            "CreateSandbox requests refused by admission: rate, starting, slots, memory or draining",
            ["reason"],
            registry=self.registry,
        )

        self.gateway_calls = Counter(
            "corral_gateway_calls", "LLM gateway calls answered (harness tasks)", registry=self.registry
        )
        self.gateway_prefix_hits = Counter(
            "corral_gateway_prefix_hits",
            "Gateway calls whose re-rendered prompt equalled the recorded ids exactly",
            registry=self.registry,
        )
        self.gateway_splices = Counter(
            "corral_gateway_splices",
            "Gateway calls whose re-rendering differed, the recorded ids kept",
            registry=self.registry,
        )
        self.gateway_splits = Counter(
            "corral_gateway_splits",
            "Gateway samples started because a harness's history was not append-only",
            registry=self.registry,
        )
        self.gateway_masked_samples = Counter(
            "corral_gateway_masked_samples", "Gateway samples delivered with mask 0", registry=self.registry
        )

    def count_gateway_session(self, counters: GatewayCounters) -> None:
        """Adds a closed gateway session's counters."""
        self.gateway_calls.inc(counters.calls)
        self.gateway_prefix_hits.inc(counters.prefix_hits)
        self.gateway_splices.inc(counters.splices)
        self.gateway_splits.inc(counters.splits)
        self.gateway_masked_samples.inc(counters.masked_samples)

    def watch_cgroups(self, held: Callable[[], Mapping[str, int]]) -> None:
        """Exports `held()` (cgroup directories the daemon holds, per hierarchy) at every scrape."""
        self.registry.register(_CgroupsHeld(held))

    def serve_http(self, listen: str, token: str = "") -> None:
        """Serves /metrics on HOST:PORT from a thread; with a token, only to scrapes that send
        `Authorization: Bearer <token>` (others get 401)."""
        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        app = make_wsgi_app(self.registry)
        if token:
            app = _bearer_protected(app, token)

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        httpd = make_server(host, int(port), app, Server, handler_class=_QuietHandler)
        threading.Thread(target=httpd.serve_forever, name="corral-metrics", daemon=True).start()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # no line on stderr per scrape


def _bearer_protected(app: Callable, token: str) -> Callable:
    expected = f"Bearer {token}".encode()

    def protected(environ: dict, start_response: Callable) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"missing or wrong bearer token\n"]
        return app(environ, start_response)

    return protected


class _CgroupsHeld(Collector):
    """corral_cgroups_held{hierarchy}: the kernel caps cgroups node-wide (65,535 memory cgroups),
    so what this daemon holds is worth watching."""

    def __init__(self, held: Callable[[], Mapping[str, int]]) -> None:
        self._held = held

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "corral_cgroups_held",
            "Cgroup directories this daemon holds now (sandboxes and their leaves), per hierarchy",
            labels=["hierarchy"],
        )
        for hierarchy, count in self._held().items():
            family.add_metric([hierarchy], count)
        yield family
