"""Noisy neighbours: the latency of `exec(["true"])` in a quiet local sandbox while other sandboxes
of the same daemon spin on the CPU.

Variants, in alternating blocks of one run:
  quiet            no other sandbox is busy
  noisy            `--busy` other sandboxes (8 by default) each run `while :; do :; done`
  daemon_quiet     GetNodeInfo (the daemon alone, no sandbox process) while no sandbox is busy
  daemon_noisy     the same while they spin: how responsive the daemon itself stays

The busy loops are started once (an ExecStream per sandbox, left running) and stopped between
the blocks of `quiet`, so that both variants see the same daemon and the same machine. The
daemon runs with the configuration `--config` names (a corral.toml; none: the defaults), which
is how a run compares the node's defaults with, say, `[limits] cpu_weight` or a CPU quota.

Usage: python bench/noisy_neighbours.py [--quick] [--json PATH] [--busy N] [--config FILE]
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from _common import (
    Daemon,
    backend_missing,
    parse_args,
    print_header,
    print_ratios,
    print_table,
    ratios,
    summary,
    time_calls,
    write_json,
)

SPIN = "while :; do :; done"


class Spinners:
    """Busy loops in other sandboxes, started and stopped as the blocks alternate."""

    def __init__(self, sandboxes: list) -> None:
        self.sandboxes = sandboxes
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for sandbox in self.sandboxes:
            thread = threading.Thread(target=self._spin, args=(sandbox,), daemon=True)
            thread.start()
            self.threads.append(thread)

    @staticmethod
    def _spin(sandbox) -> None:
        # Runs until stop() kills it; the exit status is of no interest.
        sandbox.exec(["sh", "-c", SPIN], timeout=3600)

    def stop(self) -> None:
        for sandbox in self.sandboxes:
            sandbox.exec(["sh", "-c", "pkill -KILL -f 'while :' || true"], timeout=30)
        for thread in self.threads:
            thread.join(30)
        self.threads = []


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        lambda p: (
            p.add_argument("--busy", type=int, default=8, help="sandboxes that spin (default 8)"),
            p.add_argument("--config", metavar="FILE", help="the daemon's corral.toml (default: none)"),
        ),
    )
    missing = backend_missing("local")
    if missing:
        raise SystemExit(f"cannot measure the local backend: {missing}")
    from corral.sdk import Client

    n, blocks = (40, 4) if args.quick else (200, 10)
    config = Path(args.config).read_text() if args.config else ""
    print_header(f"Noisy neighbours: exec(['true']) in a quiet local sandbox, {args.busy} others spinning")
    with Daemon(config=config) as daemon:
        client = Client(daemon.address)
        quiet = client.create_sandbox(image="host", backend="local", timeout=120)
        busy = [client.create_sandbox(image="host", backend="local", timeout=120) for _ in range(args.busy)]
        spinners = Spinners(busy)
        samples: dict[str, list[float]] = {name: [] for name in ("quiet", "noisy", "daemon_quiet", "daemon_noisy")}
        load_during_noisy: list[float] = []
        try:
            time_calls(lambda: quiet.exec(["true"]), 5)  # warm-up
            for block in range(1, blocks + 1):
                want = n * block // blocks
                samples["quiet"] += time_calls(lambda: quiet.exec(["true"]), want - len(samples["quiet"]))
                samples["daemon_quiet"] += time_calls(client.node_info, want - len(samples["daemon_quiet"]))
                spinners.start()
                time_calls(lambda: quiet.exec(["true"]), 2)  # let the spinners get going
                samples["noisy"] += time_calls(lambda: quiet.exec(["true"]), want - len(samples["noisy"]))
                samples["daemon_noisy"] += time_calls(client.node_info, want - len(samples["daemon_noisy"]))
                load_during_noisy.append(os.getloadavg()[0])
                spinners.stop()
        finally:
            for sandbox in [quiet, *busy]:
                sandbox.destroy()
    results = {name: summary(values) for name, values in samples.items()}
    values = ratios(results, [("noisy", "quiet"), ("daemon_noisy", "daemon_quiet")])
    values["noisy/quiet p99"] = round(results["noisy"]["p99_ms"] / max(results["quiet"]["p99_ms"], 1e-9), 2)
    print_table("round trips: exec(['true']) in the quiet sandbox, GetNodeInfo (daemon_*)", results)
    print_ratios(values)
    print(f"  1-minute load average at the end of each noisy block: {', '.join(f'{x:.2f}' for x in load_during_noisy)}")
    write_json(
        args.json,
        results,
        values,
        {"backend": "local", "busy": args.busy, "config": config, "load_average_noisy": load_during_noisy},
    )


if __name__ == "__main__":
    main()
