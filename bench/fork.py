"""ForkSandbox on the local backend (local.storage = "btrfs"): a parent with a workspace of
--workspace-mb of files and --root-mb of changes in its root's writable layer is forked into 1, 16
and 64 children; timed from the ForkSandbox call to every child having answered a command
(`true`, all children at once), p50 over --repeats; the ForkSandbox call alone; a cold
CreateSandbox + first command for reference; and the disk an idle child takes of its own (the
largest "exclusive" bytes of btrfs's quota groups among 64 children, after a sync).

Usage: python bench/fork.py [--quick] [--json PATH] [--workspace-mb 200] [--root-mb 300] [--repeats 5]
"""

from __future__ import annotations

import asyncio
import subprocess
import time

from _common import Daemon, parse_args, print_header, print_table, summary, write_json

from corral.sdk import AsyncClient

CONFIG = '[local]\nstorage = "btrfs"\n[daemon]\nmax_sandboxes = 200\n'
COUNTS = (1, 16, 64)


def exclusive_bytes(daemon: Daemon, sandbox_ids: list[str]) -> list[int]:
    """What each sandbox's subvolume holds that no other does (data and metadata), as btrfs's
    quota groups count it: a child's cost on disk beyond what it shares with its parent."""
    pool = daemon.root / "state" / "storage"
    subprocess.run(["sync", "-f", str(pool)], check=True)
    out = subprocess.run(
        ["btrfs", "qgroup", "show", "--raw", "--sync", "-re", str(pool)], capture_output=True, text=True, check=True
    ).stdout
    by_path = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[0].startswith("0/"):
            by_path[fields[-1].rsplit("/", 1)[-1]] = int(fields[2])
    return [by_path[sid] for sid in sandbox_ids]


async def fork_and_answer(parent, count: int) -> tuple[float, float, list]:
    """(ms to all children answering, ms of the ForkSandbox call, the children)."""
    start = time.perf_counter()
    children = await parent.fork(count, timeout=300)
    forked = time.perf_counter()
    results = await asyncio.gather(*(child.exec(["true"]) for child in children))
    done = time.perf_counter()
    assert all(r.exit_code == 0 for r in results)
    return (done - start) * 1000, (forked - start) * 1000, children


async def run(args, daemon: Daemon) -> tuple[dict, dict]:
    results: dict[str, dict] = {}
    extra: dict = {}
    async with AsyncClient(daemon.address) as client:
        parent = await client.create_sandbox(timeout=120)
        await parent.exec(
            f"dd if=/dev/urandom of=/workspace/data bs=1M count={args.workspace_mb} status=none && "
            f"dd if=/dev/urandom of=/usr/local/root-change bs=1M count={args.root_mb} status=none",
            timeout=600,
        )
        cold = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            sandbox = await client.create_sandbox()
            await sandbox.exec(["true"])
            cold.append((time.perf_counter() - start) * 1000)
            await sandbox.destroy()
        results["cold create + first command"] = summary(cold)
        for count in COUNTS:
            total, call = [], []
            for _ in range(args.repeats):
                all_ms, fork_ms, children = await fork_and_answer(parent, count)
                total.append(all_ms)
                call.append(fork_ms)
                if count == COUNTS[-1] and "disk_per_idle_child_bytes" not in extra:
                    own = exclusive_bytes(daemon, [child.id for child in children])
                    extra["disk_per_idle_child_bytes"] = max(own)
                await asyncio.gather(*(child.destroy() for child in children))
            results[f"fork {count}: all children answered"] = summary(total)
            results[f"fork {count}: ForkSandbox call"] = summary(call)
        await parent.destroy()
    return results, extra


def main() -> None:
    def options(parser):
        parser.add_argument("--workspace-mb", type=int, default=200)
        parser.add_argument("--root-mb", type=int, default=300)
        parser.add_argument("--repeats", type=int, default=5)

    args = parse_args(__doc__ or "", options)
    if args.quick:
        args.workspace_mb, args.root_mb, args.repeats = 20, 30, 2
    print_header(
        f"ForkSandbox, local backend, btrfs storage ({args.workspace_mb} MB workspace, {args.root_mb} MB root)"
    )
    with Daemon(config=CONFIG) as daemon:
        results, extra = asyncio.run(run(args, daemon))
    print_table("time (ms)", results)
    print(
        f"  disk per idle child: at most {extra['disk_per_idle_child_bytes'] / 1024:.0f} KiB of its own (64 children)"
    )
    print_header("after the run")
    write_json(args.json, results, {}, {"backend": "local", **extra, **vars(args)})


if __name__ == "__main__":
    main()
