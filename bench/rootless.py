"""A backend without root against the same backend as root, on the same machine in the same run:
a root daemon and a daemon run as an unprivileged user, in alternating blocks. --backend local
(docs/local-backend.md, "Without root") runs the "host" image; --backend singularity
(docs/backends.md, "Apptainer / Singularity", "Without root") the test SIF image
($CORRAL_TEST_SIF_IMAGE, default /var/cache/corral-test-images/python-bookworm.sif).

Variants, per daemon (root_*, rootless_*):
  create       client.create_sandbox(image=IMAGE) until it answers (destroyed untimed after)
  first_exec   create_sandbox + sb.exec(["true"]): a sandbox up to its first command
  exec         sb.exec(["true"]) in a sandbox kept for the run
  shell_turn   sh.run("true") in a shell session kept for the run
and, with --backend local, the floor for a sandbox up to its first command:
  raw_first_exec   `bwrap --unshare-all --die-with-parent --ro-bind / / --proc /proc --dev /dev true`
                   run as the same user (namespaces, no writable root, no daemon)
and, with --backend local --forks, ForkSandbox on the rootless daemon alone (the root daemon's
needs its btrfs pool: bench/fork.py): a "host" parent holding --fork-mb MB (half in its
workspace, half in its root's writable layer) forked into 1 and 16 children, timed from the call
to every child having answered `true`, p50 over the runs, with each disk cap: a capped tmpfs
(disk_bytes 1 GiB, the default local.rootless_tmpfs_max_bytes) and a watched one (4 GiB):
  rootless_fork_{tmpfs,watched}_{1,16}

Run as root: the rootless daemon runs as --user (default corral-rootless, which must exist:
`useradd --system --no-create-home corral-rootless`; tests/integration/test_rootless.py makes it
too). Where that user cannot execute this Python (a virtual environment whose base interpreter
lies under root's home), it runs /usr/bin/python3 of the same version with this environment's
site-packages.

Usage: python bench/rootless.py [--quick] [--json PATH] [--user NAME] [--backend local|singularity]
                                [--forks] [--fork-mb 200]
"""

from __future__ import annotations

import functools
import os
import pwd
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable

from _common import (
    Daemon,
    interleaved,
    interleaved_phases,
    parse_args,
    print_header,
    print_ratios,
    print_table,
    ratios,
    summary,
    write_json,
)

from corral.sdk import Client

SYSTEM_PYTHON = "/usr/bin/python3"
# The image each backend's sandboxes run.
IMAGES = {
    "local": "host",
    "singularity": os.environ.get("CORRAL_TEST_SIF_IMAGE", "/var/cache/corral-test-images/python-bookworm.sif"),
}


class UnprivilegedDaemon(Daemon):
    """`corral serve` as `user`, exec'd in place by setpriv (the pid stays the daemon's)."""

    def __init__(self, user: pwd.struct_passwd) -> None:
        super().__init__()
        self.user = user
        self.root.chmod(0o755)
        os.chown(self.root, user.pw_uid, user.pw_gid)
        boot = self.root / "boot"
        boot.mkdir()
        (boot / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
        self.as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
        self.env = ["env", f"HOME={self.root}", f"TMPDIR={self.root}", f"PYTHONPATH={boot}"]

    def command(self) -> list[str]:
        python = sys.executable
        if subprocess.run([*self.as_user, "env", python, "-c", "pass"], capture_output=True).returncode != 0:
            python = SYSTEM_PYTHON
        return [*self.as_user, *self.env, python, "-m", "corral.cli", "serve"]


# What the daemon's rootless first_exec is compared with: bubblewrap alone, as the same user.
RAW_FIRST_EXEC = {
    "local": [
        "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--ro-bind",
        "/",
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "true",
    ],
}


def timed_raw(as_user: list[str], argv: list[str]) -> dict[str, float]:
    start = time.perf_counter()
    subprocess.run([*as_user, *argv], check=True, capture_output=True, timeout=60)
    return {"first_exec": (time.perf_counter() - start) * 1000}


def timed_create(client: Client, backend: str, first_exec: bool) -> dict[str, float]:
    start = time.perf_counter()
    sb = client.create_sandbox(image=IMAGES[backend], backend=backend, timeout=300)
    if first_exec:
        sb.exec(["true"], timeout=30)
    ms = (time.perf_counter() - start) * 1000
    sb.destroy()
    return {"first_exec" if first_exec else "create": ms}


# The disk caps of the fork variants: one a capped tmpfs holds, one the daemon watches.
FORK_DISK_CAPS = {"tmpfs": 1 << 30, "watched": 4 << 30}


def fork_times(client: Client, fork_mb: int, runs: int) -> dict[str, dict]:
    """rootless_fork_{cap}_{count}: a parent holding `fork_mb` MB forked into `count` children,
    up to every child's first answer, `runs` times each (alternating), p50 and p99."""
    samples: dict[str, list[float]] = {}
    for cap_name, cap in FORK_DISK_CAPS.items():
        parent = client.create_sandbox(image="host", disk_bytes=cap, memory_bytes=2 << 30, timeout=300)
        half = fork_mb // 2
        fill = f"head -c {half}M /dev/urandom > /workspace/data && head -c {half}M /dev/urandom > /usr/data"
        parent.exec(fill, timeout=300).check()
        for _ in range(runs):
            for count in (1, 16):
                start = time.perf_counter()
                children = parent.fork(count, timeout=300)
                for child in children:
                    child.exec(["true"], timeout=60)
                ms = (time.perf_counter() - start) * 1000
                samples.setdefault(f"rootless_fork_{cap_name}_{count}", []).append(ms)
                for child in children:
                    child.destroy()
        parent.destroy()
    return {name: summary(values) for name, values in samples.items()}


def main() -> None:
    def options(parser) -> None:
        parser.add_argument("--user", default="corral-rootless")
        parser.add_argument("--backend", choices=sorted(IMAGES), default="local")
        parser.add_argument("--forks", action="store_true", help="also time forks on the rootless daemon (local)")
        parser.add_argument("--fork-mb", type=int, default=200)

    args = parse_args(__doc__ or "", options)
    backend = args.backend
    if os.geteuid() != 0:
        sys.exit("run as root: it compares a root daemon with one it starts as --user")
    user = pwd.getpwnam(args.user)
    n, warmup = (10, 2) if args.quick else (100, 5)
    print_header(f"{backend} backend, root vs rootless daemon (user {user.pw_name}, image {IMAGES[backend]})")
    with Daemon() as root_daemon, UnprivilegedDaemon(user) as rootless_daemon:
        clients = {"root": Client(root_daemon.address), "rootless": Client(rootless_daemon.address)}
        variants: dict[str, Callable[[], dict[str, float]]] = {
            f"{who}_{kind}": functools.partial(timed_create, c, backend, first)
            for who, c in clients.items()
            for kind, first in (("create", False), ("first_exec", True))
        }
        if backend in RAW_FIRST_EXEC:
            as_user, raw = rootless_daemon.as_user, RAW_FIRST_EXEC[backend]
            variants["raw_first_exec"] = functools.partial(timed_raw, as_user, raw)
        starts = interleaved_phases(variants, n, warmup)
        # (Each start variant times one phase, named by its kind.)
        results = {variant: summary(next(iter(phases.values()))) for variant, phases in starts.items()}
        kept = {
            who: c.create_sandbox(image=IMAGES[backend], backend=backend, timeout=300) for who, c in clients.items()
        }
        shells = {who: sb.shell("bench") for who, sb in kept.items()}
        calls = {f"{who}_exec": (lambda sb=sb: sb.exec(["true"], timeout=30)) for who, sb in kept.items()}
        calls |= {f"{who}_shell_turn": (lambda sh=sh: sh.run("true", timeout=30)) for who, sh in shells.items()}
        results |= {name: summary(samples) for name, samples in interleaved(calls, n * 3, warmup).items()}
        for sb in kept.values():
            sb.destroy()
        if args.forks and backend == "local":
            results |= fork_times(clients["rootless"], args.fork_mb, 5 if args.quick else 10)
        for c in clients.values():
            c.close()
    print_table("latency (ms)", results)
    pairs = [(f"rootless_{kind}", f"root_{kind}") for kind in ("create", "first_exec", "exec", "shell_turn")]
    if "raw_first_exec" in results:
        pairs.append(("rootless_first_exec", "raw_first_exec"))
    ratio_values = ratios(results, pairs)
    print_ratios(ratio_values)
    write_json(
        args.json, results, ratio_values, {"load_average": os.getloadavg(), "user": user.pw_name, "backend": backend}
    )


if __name__ == "__main__":
    main()
