"""ForkSandbox on the local backend (local.storage = "btrfs"): a parent with a workspace of
--workspace-mb of files and --root-mb of changes in its root's writable layer is forked into 1, 16
and 64 children; timed from the ForkSandbox call to every child having answered a command
(`true`, all children at once), p50 over --repeats; the ForkSandbox call alone; a cold
CreateSandbox + first command for reference; and the disk an idle child takes of its own (the
largest "exclusive" bytes of btrfs's quota groups among 64 children, after a sync).

Then INIT once in the rollout service: --rollout-tasks tasks of --samples samples each (n = 8),
whose setup takes --setup-s (2 s), replayed by the built-in reference server (a bash call and
submit), all submitted at once on one stream with the daemon's default worker pools (8 INIT
workers), with INIT once and with TaskSetup.per_rollout (an INIT per rollout): rollouts/s from the
first submission to the last result; through INIT alone (rollouts over the time until the last one
had its sandbox); the INIT span a rollout sees (init + fork, p50 and p99); the INIT work per
rollout (each INIT's set-up and fork counted once, over the rollouts); RUN + EVAL p50.

Usage: python bench/fork.py [--quick] [--json PATH] [--workspace-mb 200] [--root-mb 300] [--repeats 5]
                            [--rollout-tasks 8] [--samples 8] [--setup-s 2]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import time

from _common import Daemon, parse_args, print_header, print_table, summary, write_json

from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer
from corral.sdk import AsyncClient
from corral.v1 import rollout_pb2 as pb

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


def setup_task(task_id: str, setup_s: float, *, init_once: bool) -> pb.Task:
    """A task whose setup writes a file and takes `setup_s`; solved by one bash call and submit."""

    def call(name: str, **arguments: object) -> pb.ToolCall:
        return pb.ToolCall(name=name, arguments_json=json.dumps(arguments))

    task = pb.Task(task_id=task_id, tools=["bash", "submit"])
    task.setup.files.add(path="ready.txt", content=b"ready\n")
    task.setup.commands.append(f"sleep {setup_s}")
    task.setup.per_rollout = not init_once
    task.prompt.messages.add(role="user", content=f"[{task_id}] print ready.txt, then submit.")
    task.reference_solution.extend([call("bash", command="cat ready.txt"), call("submit")])
    task.evaluation.commands.append("grep -q ready ready.txt")
    task.evaluation.exit_status.SetInParent()
    return task


async def rollouts_with_setup(client: AsyncClient, args, *, init_once: bool) -> tuple[dict, dict]:
    """(INIT spans as a summary, {rollouts_per_s, INIT work per rollout}) of one run."""
    mode = "once" if init_once else "each"
    tasks = [setup_task(f"setup-{mode}-{i}", args.setup_s, init_once=init_once) for i in range(args.rollout_tasks)]
    server = ReferenceServer(ReplayPolicy(tasks))
    await server.start()
    try:
        info = await client.rollouts.register_llm(server.url)
        start = time.perf_counter()
        results = [r async for r in client.rollouts.stream(tasks, n=args.samples)]
        wall = time.perf_counter() - start
        await client.rollouts.remove_llm(info.address)
    finally:
        await server.stop()
    failed = [r for r in results if r.status != "completed" or r.reward != 1.0]
    assert not failed, [(r.rollout_id, r.status, r.filter_reason, r.error) for r in failed]
    assert all(bool(r.init_shared_by) == init_once for r in results), "INIT once did not happen as asked"
    spans = [(r.timings["init"] + r.timings["fork"]) * 1000 for r in results]
    # When the last rollout had its sandbox, from the submissions (all at once): INIT's own pace.
    ready = max(r.timings["init_queue"] + r.timings["init"] + r.timings["fork"] for r in results)
    # What the node spent on INITs: a shared one (its set-up and fork) once per group.
    work = {r.group_id if init_once else r.rollout_id: r.timings["init"] + r.timings["fork"] for r in results}
    return summary(spans), {
        "rollouts": len(results),
        "wall_s": round(wall, 2),
        "rollouts_per_s": round(len(results) / wall, 3),
        "all_sandboxes_ready_s": round(ready, 2),
        "sandboxes_ready_per_s": round(len(results) / ready, 3),
        "init_work_per_rollout_ms": round(1000 * sum(work.values()) / len(results), 1),
        "init_span_p50_ms": round(statistics.median(spans), 1),
        "fork_p50_ms": round(1000 * statistics.median(r.timings["fork"] for r in results), 1),
        "run_and_eval_p50_ms": round(
            1000 * statistics.median(r.timings["run"] + r.timings["eval"] for r in results), 1
        ),
    }


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
        rollouts = {}
        for init_once in (False, True):
            name = "INIT once" if init_once else "INIT per rollout"
            (
                results[f"n={args.samples}, {args.setup_s:g} s setup, {name}: INIT span"],
                rollouts[name],
            ) = await rollouts_with_setup(client, args, init_once=init_once)
        extra["rollouts"] = rollouts
    return results, extra


def main() -> None:
    def options(parser):
        parser.add_argument("--workspace-mb", type=int, default=200)
        parser.add_argument("--root-mb", type=int, default=300)
        parser.add_argument("--repeats", type=int, default=5)
        parser.add_argument("--rollout-tasks", type=int, default=None, help="default 8 (--quick: 2)")
        parser.add_argument("--samples", type=int, default=8)
        parser.add_argument("--setup-s", type=float, default=2.0)

    args = parse_args(__doc__ or "", options)
    if args.quick:
        args.workspace_mb, args.root_mb, args.repeats = 20, 30, 2
    if args.rollout_tasks is None:
        args.rollout_tasks = 2 if args.quick else 8
    print_header(
        f"ForkSandbox, local backend, btrfs storage ({args.workspace_mb} MB workspace, {args.root_mb} MB root)"
    )
    with Daemon(config=CONFIG) as daemon:
        results, extra = asyncio.run(run(args, daemon))
    print_table("time (ms)", results)
    print(
        f"  disk per idle child: at most {extra['disk_per_idle_child_bytes'] / 1024:.0f} KiB of its own (64 children)"
    )
    print(f"\nrollouts, {args.rollout_tasks} tasks x n={args.samples}, {args.setup_s:g} s setup, 8 INIT workers")
    for name, numbers in extra["rollouts"].items():
        print(
            f"  {name:<16}  {numbers['rollouts_per_s']:7.2f} rollouts/s, INIT work per rollout "
            f"{numbers['init_work_per_rollout_ms']:8.1f} ms, INIT span p50 {numbers['init_span_p50_ms']:8.1f} ms "
            f"(fork {numbers['fork_p50_ms']:.1f} ms), RUN + EVAL p50 {numbers['run_and_eval_p50_ms']:.1f} ms"
        )
    once, each = extra["rollouts"]["INIT once"], extra["rollouts"]["INIT per rollout"]
    for name, numbers in extra["rollouts"].items():
        print(
            f"  {name:<16}  every sandbox ready after {numbers['all_sandboxes_ready_s']:.2f} s: "
            f"{numbers['sandboxes_ready_per_s']:.2f} rollouts/s through INIT"
        )
    print(
        f"  INIT once / INIT per rollout: {once['rollouts_per_s'] / each['rollouts_per_s']:.2f}x the rollouts/s, "
        f"{once['sandboxes_ready_per_s'] / each['sandboxes_ready_per_s']:.2f}x through INIT"
    )
    print_header("after the run")
    write_json(args.json, results, {}, {"backend": "local", **extra, **vars(args)})


if __name__ == "__main__":
    main()
