"""ForkSandbox on every backend that has it, in one run: on each of --backends (default: all of
local, docker, podman and singularity that this node can run), a parent with a workspace of
--workspace-mb of files and --root-mb of changes in its root's writable layer is forked into each
of --counts children (1, 16 and 64; --engine-counts for docker, podman and singularity, default the
same); timed from the ForkSandbox call to every child having answered a command (`true`, all
children at once), p50 over --repeats; the ForkSandbox call alone; a cold CreateSandbox + first
command for reference; and the disk an idle child takes of its own, among the children of the
largest count (once): on local, docker and podman (`storage = "btrfs"`) the largest "exclusive"
bytes of btrfs's quota groups, after a sync; on singularity (a copy of the parent's layer and
workspace, reflinked where the filesystem can) the largest `du` of a child's root writable layer
and workspace.

Each backend's mechanism: local with `local.storage = "btrfs"` and docker/podman with
`docker.storage = "btrfs"` snapshot the parent's subvolume (podman: the docker backend on Podman's
socket, a daemon of its own); singularity copies (`cp -a --reflink=auto`) the parent's root
writable layer and workspace.

Then, per backend, a daemon of its own with the same configuration and a [[pool]] of the shape the
creates ask for (the backend's test image, default limits), filled before timing: CreateSandbox
alone at the SDK, --pool-creates times, served from the pool ("create: warm pool") alternating
with the same request plus one env var no pool prepared ("create: cold, same daemon"; refills run
meanwhile).

Then (local only) INIT once in the rollout service: --rollout-tasks tasks of --samples samples each
(n = 8), whose setup takes --setup-s (2 s), replayed by the built-in reference server (a bash call
and submit), all submitted at once on one stream with the daemon's default worker pools (8 INIT
workers), with INIT once and with TaskSetup.per_rollout (an INIT per rollout): rollouts/s from the
first submission to the last result; through INIT alone (rollouts over the time until the last one
had its sandbox); the INIT span a rollout sees (init + fork, p50 and p99); the INIT work per
rollout (each INIT's set-up and fork counted once, over the rollouts); RUN + EVAL p50.

Usage: python bench/fork.py [--quick] [--json PATH] [--backends local,docker,podman,singularity]
                            [--workspace-mb 200] [--root-mb 300] [--repeats 5] [--counts 1,16,64]
                            [--engine-counts 1,16,64] [--pool-creates 10]
                            [--rollout-tasks 8] [--samples 8] [--setup-s 2]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import time

from _common import (
    BACKEND_IMAGES,
    BACKENDS,
    PODMAN_CONFIG,
    Daemon,
    backend_missing,
    parse_args,
    print_header,
    print_table,
    summary,
    write_json,
)

from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer
from corral.sdk import AsyncClient
from corral.sdk.errors import CorralError
from corral.v1 import rollout_pb2 as pb

ENGINE_STORAGE = '[docker]\nstorage = "btrfs"\nstorage_bytes = 8589934592\n'
# Each backend's daemon: its copy-on-write storage (singularity needs none: it copies).
BACKEND_CONFIGS = {
    "local": '[local]\nstorage = "btrfs"\n',
    "docker": ENGINE_STORAGE,
    "podman": ENGINE_STORAGE + PODMAN_CONFIG.removeprefix("[docker]\n"),
    "singularity": "",
}
DAEMON_CONFIG = "[daemon]\nmax_sandboxes = 200\n"
COUNTS = "1,16,64"


def engine_backend(backend: str) -> str:
    """The daemon's name of `backend`: podman is the docker backend on Podman's socket."""
    return "docker" if backend == "podman" else backend


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


def copied_bytes(daemon: Daemon, sandbox_ids: list[str]) -> list[int]:
    """What `du` counts of each Apptainer sandbox's root writable layer and workspace (the copy a
    fork makes; shared extents of reflinks are counted in full, so this is an upper bound)."""
    sizes = []
    for sid in sandbox_ids:
        sandbox_dir = daemon.root / "state" / "sandboxes" / sid
        out = subprocess.run(
            [
                "du",
                "-s",
                "-x",
                "-c",
                "--block-size=1",
                str(sandbox_dir / "layers" / "upper"),
                str(sandbox_dir / "workspace"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        sizes.append(int(out.splitlines()[-1].split()[0]))
    return sizes


async def fork_and_answer(parent, count: int) -> tuple[float, float, list]:
    """(ms to all children answering, ms of the ForkSandbox call, the children)."""
    start = time.perf_counter()
    children = await parent.fork(count, timeout=600)
    forked = time.perf_counter()
    results = await asyncio.gather(*(child.exec(["true"]) for child in children))
    done = time.perf_counter()
    assert all(r.exit_code == 0 for r in results)
    return (done - start) * 1000, (forked - start) * 1000, children


async def forks(args, backend: str, daemon: Daemon, client: AsyncClient, counts: list[int]) -> tuple[dict, dict]:
    """The fork table of one backend (and the cold create beside it), and {disk per idle child}."""
    results: dict[str, dict] = {}
    extra: dict = {}
    image, kind = BACKEND_IMAGES[backend], engine_backend(backend)
    parent = await client.create_sandbox(image=image, backend=kind, timeout=300)
    try:
        await parent.exec(
            f"dd if=/dev/urandom of=/workspace/data bs=1M count={args.workspace_mb} status=none && "
            f"dd if=/dev/urandom of=/usr/local/root-change bs=1M count={args.root_mb} status=none",
            timeout=600,
        )
        cold = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            sandbox = await client.create_sandbox(image=image, backend=kind, timeout=300)
            await sandbox.exec(["true"])
            cold.append((time.perf_counter() - start) * 1000)
            await sandbox.destroy()
        results["cold create + first command"] = summary(cold)
        for count in counts:
            total, call = [], []
            for _ in range(args.repeats):
                all_ms, fork_ms, children = await fork_and_answer(parent, count)
                total.append(all_ms)
                call.append(fork_ms)
                if count == counts[-1] and "disk_per_idle_child_bytes" not in extra:
                    ids = [child.id for child in children]
                    own = copied_bytes(daemon, ids) if backend == "singularity" else exclusive_bytes(daemon, ids)
                    extra["disk_per_idle_child_bytes"], extra["disk_children"] = max(own), count
                await asyncio.gather(*(child.destroy() for child in children))
            results[f"fork {count}: all children answered"] = summary(total)
            results[f"fork {count}: ForkSandbox call"] = summary(call)
    finally:
        await parent.destroy()
    return results, extra


async def pool_creates(args, backend: str) -> dict[str, dict]:
    """CreateSandbox alone from a filled warm pool of the backend's test image, alternating with
    the same request that no pool prepared (one env var more); each pair destroyed untimed."""
    image, kind = BACKEND_IMAGES[backend], engine_backend(backend)
    n = args.pool_creates
    config = (
        DAEMON_CONFIG
        + BACKEND_CONFIGS[backend]
        + f'[[pool]]\nname = "bench"\nsize = {n + 1}\nbackend = "{kind}"\nimage = "{image}"\n'
    )
    samples: dict[str, list[float]] = {"create: warm pool": [], "create: cold, same daemon": []}
    with Daemon(config=config) as daemon:
        async with AsyncClient(daemon.address) as client:
            deadline = time.monotonic() + 600
            while (pool := (await client.node_info()).pools[0]).ready < pool.size:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {backend} pool did not fill: {pool}")
                await asyncio.sleep(0.05)
            for _ in range(n):
                made = []
                for name, env in (("create: warm pool", {}), ("create: cold, same daemon", {"CORRAL_BENCH": "cold"})):
                    start = time.perf_counter()
                    made.append(await client.create_sandbox(image=image, backend=kind, env=env, timeout=300))
                    samples[name].append((time.perf_counter() - start) * 1000)
                for sandbox in made:
                    await sandbox.destroy()
    return {name: summary(values) for name, values in samples.items()}


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


async def measure(args, backend: str, counts: list[int]) -> tuple[dict, dict]:
    """One backend: its forks and disk on a daemon of its own (then, on local, INIT once), then its
    warm pool on another. A backend this daemon cannot run or fork on is skipped, with why."""
    rollouts: dict = {}
    with Daemon(config=DAEMON_CONFIG + BACKEND_CONFIGS[backend]) as daemon:
        async with AsyncClient(daemon.address) as client:
            results, extra = await forks(args, backend, daemon, client, counts)
            if backend == "local":
                for init_once in (False, True):
                    name = "INIT once" if init_once else "INIT per rollout"
                    (
                        results[f"n={args.samples}, {args.setup_s:g} s setup, {name}: INIT span"],
                        rollouts[name],
                    ) = await rollouts_with_setup(client, args, init_once=init_once)
                extra["rollouts"] = rollouts
    results.update(await pool_creates(args, backend))
    return results, extra


def counts_of(text: str) -> list[int]:
    counts = sorted({int(c) for c in text.split(",") if c.strip()})
    if not counts or not all(1 <= c <= 64 for c in counts):
        raise SystemExit(f"counts must be 1..64 (ForkSandbox's range), got {text!r}")
    return counts


def print_rollouts(args, rollouts: dict) -> None:
    print(
        f"\nrollouts (local), {args.rollout_tasks} tasks x n={args.samples}, {args.setup_s:g} s setup, 8 INIT workers"
    )
    for name, numbers in rollouts.items():
        print(
            f"  {name:<16}  {numbers['rollouts_per_s']:7.2f} rollouts/s, INIT work per rollout "
            f"{numbers['init_work_per_rollout_ms']:8.1f} ms, INIT span p50 {numbers['init_span_p50_ms']:8.1f} ms "
            f"(fork {numbers['fork_p50_ms']:.1f} ms), RUN + EVAL p50 {numbers['run_and_eval_p50_ms']:.1f} ms"
        )
    once, each = rollouts["INIT once"], rollouts["INIT per rollout"]
    for name, numbers in rollouts.items():
        print(
            f"  {name:<16}  every sandbox ready after {numbers['all_sandboxes_ready_s']:.2f} s: "
            f"{numbers['sandboxes_ready_per_s']:.2f} rollouts/s through INIT"
        )
    print(
        f"  INIT once / INIT per rollout: {once['rollouts_per_s'] / each['rollouts_per_s']:.2f}x the rollouts/s, "
        f"{once['sandboxes_ready_per_s'] / each['sandboxes_ready_per_s']:.2f}x through INIT"
    )


def print_overview(measured: dict[str, dict], extras: dict[str, dict]) -> None:
    """p50 of every row, one column per backend, and the disk per idle child below."""
    rows = list(dict.fromkeys(row for results in measured.values() for row in results if "INIT" not in row))
    width = max(len(row) for row in rows)
    print(f"\np50 ms by backend\n  {'':<{width}}" + "".join(f"  {b:>11}" for b in measured))
    for row in rows:
        cells = (f"{r[row]['p50_ms']:>11.1f}" if row in r else f"{'-':>11}" for r in measured.values())
        print(f"  {row:<{width}}" + "".join(f"  {c}" for c in cells))
    disk = (
        f"{e['disk_per_idle_child_bytes'] / 1024:>7.0f} KiB" if "disk_per_idle_child_bytes" in e else f"{'-':>11}"
        for e in extras.values()
    )
    print(f"  {'disk per idle child (own)':<{width}}" + "".join(f"  {c:>11}" for c in disk))
    print(f"  {'  among children':<{width}}" + "".join(f"  {e.get('disk_children', '-'):>11}" for e in extras.values()))


def main() -> None:
    def options(parser):
        parser.add_argument(
            "--backends", default=",".join(BACKENDS), help="comma-separated, of: " + ", ".join(BACKENDS)
        )
        parser.add_argument("--workspace-mb", type=int, default=200)
        parser.add_argument("--root-mb", type=int, default=300)
        parser.add_argument("--repeats", type=int, default=5)
        parser.add_argument("--counts", default=COUNTS, help="children per fork on local (1..64)")
        parser.add_argument("--engine-counts", default=None, help="on docker, podman, singularity (default: --counts)")
        parser.add_argument("--pool-creates", type=int, default=None, help="default 10 (--quick: 3)")
        parser.add_argument("--rollout-tasks", type=int, default=None, help="default 8 (--quick: 2)")
        parser.add_argument("--samples", type=int, default=8)
        parser.add_argument("--setup-s", type=float, default=2.0)

    args = parse_args(__doc__ or "", options)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if unknown := [b for b in backends if b not in BACKENDS]:
        raise SystemExit(f"unknown backend(s): {', '.join(unknown)}; known: {', '.join(BACKENDS)}")
    if args.quick:
        args.workspace_mb, args.root_mb, args.repeats = 20, 30, 2
    if args.rollout_tasks is None:
        args.rollout_tasks = 2 if args.quick else 8
    if args.pool_creates is None:
        args.pool_creates = 3 if args.quick else 10
    local_counts = counts_of(args.counts)
    engine_counts = counts_of(args.engine_counts or args.counts)
    print_header(
        f"ForkSandbox on {', '.join(backends)} ({args.workspace_mb} MB workspace, {args.root_mb} MB root, "
        f"{args.repeats} repeats; children {args.counts} on local, {args.engine_counts or args.counts} on the engines)"
    )
    measured: dict[str, dict] = {}
    extras: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for backend in backends:
        if reason := backend_missing(backend):
            skipped[backend] = reason
            continue
        counts = local_counts if backend == "local" else engine_counts
        started = time.monotonic()
        try:
            measured[backend], extras[backend] = asyncio.run(measure(args, backend, counts))
        except (CorralError, RuntimeError) as err:  # RuntimeError: a daemon or pool that did not start
            skipped[backend] = f"could not measure: {err}"
            continue
        print_table(f"{backend}: time (ms), measured in {time.monotonic() - started:.0f} s", measured[backend])
        if "disk_per_idle_child_bytes" in extras[backend]:
            print(
                f"  disk per idle child: at most {extras[backend]['disk_per_idle_child_bytes'] / 1024:.0f} KiB "
                f"of its own ({extras[backend]['disk_children']} children)"
            )
        if "rollouts" in extras[backend]:
            print_rollouts(args, extras[backend]["rollouts"])
    if measured:
        print_overview(measured, extras)
    for backend, reason in skipped.items():
        print(f"  {backend}: skipped: {reason}")
    print_header("after the run")
    results = {f"{backend}: {row}": numbers for backend, rows in measured.items() for row, numbers in rows.items()}
    write_json(args.json, results, {}, {"backends": backends, "skipped": skipped, "by_backend": extras, **vars(args)})


if __name__ == "__main__":
    main()
