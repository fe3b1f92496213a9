"""`corral run TASKS.jsonl --llm URL|builtin:replay|builtin:tiny --out results.jsonl`: runs every
task through a daemon's RolloutService, with a progress bar per stage, results written as they
finish, and a summary table at the end.

Without --address (and without $CORRAL_ADDRESS / $CORRAL_SOCKET) the daemon is embedded: started in
this process on a private socket, with local sandboxes. `builtin:*` LLMs are the built-in
reference server, started in this process too.

The built-in server's registration on the daemon is removed again when the command ends, however
it ends (Ctrl-C and SIGTERM included), so that a daemon that outlives it never sends requests to a
server that is gone.

Exit status: 0 when every rollout completed (whatever its reward), 1 when any was filtered or
cancelled, 2 for unusable input, 130 after Ctrl-C, 143 after SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from corral.sdk import AsyncClient
from corral.sdk.errors import CorralError, NotFound
from corral.sdk.tasks import load_tasks
from corral.sdk.types import RolloutResult

if TYPE_CHECKING:
    from corral.rollout.reference.policies import Policy

BUILTIN_POLICIES = ("builtin:replay", "builtin:tiny")
STAGES = ("init", "run", "eval")
# How long removing the built-in server's registration may take when the command ends.
UNREGISTER_TIMEOUT_S = 10.0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        help="run rollouts of tasks from JSONL files and write the results",
        description="Runs every task through a daemon's rollout service and writes the results as they finish. "
        "Without --address (and without $CORRAL_ADDRESS or $CORRAL_SOCKET) it starts a daemon of its own in this "
        "process, on a private socket, with local sandboxes; builtin:* LLMs are started in this process too. "
        "Exit status: 0 when every rollout completed (whatever its reward), 1 when any was filtered or cancelled, "
        "2 for unusable input.",
    )
    run.add_argument("tasks", nargs="+", help="JSONL files, one corral task per line")
    run.add_argument(
        "--llm",
        action="append",
        default=[],
        metavar="URL|builtin:replay|builtin:tiny",
        help="LLM server to generate with (repeatable); builtin:* starts the built-in reference server",
    )
    run.add_argument("--protocol", default="sglang", choices=["sglang", "vllm"], help="protocol of URL servers")
    run.add_argument("--out", default=None, help="write each result as a JSON line here")
    run.add_argument("-n", "--samples", type=int, default=1, help="rollouts per task (one group each)")
    run.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        metavar="VERSIONS",
        help="filter a rollout whose oldest turn was generated more than VERSIONS policy versions before the "
        "current one (default: no limit)",
    )
    run.add_argument(
        "--tokenizer",
        default=None,
        help="embedded daemon only: 'byte' (default) or a local Hugging Face tokenizer directory",
    )
    run.add_argument("--checkpoint", default=None, help="builtin:tiny weights (torch state dict)")
    run.add_argument("--no-progress", action="store_true", help="no progress bars (also when not a terminal)")
    run.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    tasks = load_tasks(*args.tasks)
    if not tasks:
        print("corral run: no tasks in " + ", ".join(args.tasks), file=sys.stderr)
        return 2
    llms = args.llm or ["builtin:replay"]
    try:
        results, wall_s = asyncio.run(_run(args, tasks, llms))
    except KeyboardInterrupt:
        print("corral run: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except asyncio.CancelledError:  # SIGTERM (see _run)
        print("corral run: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    summary = summarize(results, wall_s=wall_s)
    print_summary(summary)
    return 0 if summary.completed == summary.total else 1


async def _run(args: argparse.Namespace, tasks: list, llms: list[str]) -> tuple[list[RolloutResult], float]:
    # SIGTERM cancels this task as Ctrl-C does (asyncio.run), so that the cleanup below runs.
    main = asyncio.current_task()
    assert main is not None
    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread, or no signals
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    address = args.address or os.environ.get("CORRAL_ADDRESS") or os.environ.get("CORRAL_SOCKET")
    async with contextlib.AsyncExitStack() as stack:
        if address is None:
            from corral.daemon.embedded import embedded_daemon

            overrides = {"tokenizer": args.tokenizer} if args.tokenizer else {}
            address = await stack.enter_async_context(embedded_daemon(**overrides))
        client = await stack.enter_async_context(AsyncClient(address))
        for llm in llms:
            if llm in BUILTIN_POLICIES:
                url = await stack.enter_async_context(_builtin_server(llm, tasks, args.checkpoint))
                # Removed before the server stops, whatever ends the command (pushed first: a
                # registration the daemon made while the call was being cancelled goes too).
                stack.push_async_callback(_remove_llm, client, url)
                await client.rollouts.register_llm(url, protocol="sglang")
            else:
                await client.rollouts.register_llm(llm, protocol=args.protocol)
        out = stack.enter_context(open(args.out, "w", encoding="utf-8")) if args.out else None
        show_progress = not args.no_progress and sys.stderr.isatty()
        return await _collect(client, tasks, args, out, show_progress)


async def _remove_llm(client: AsyncClient, url: str) -> None:
    """Takes the built-in server out of the daemon's pool (it stops with this command)."""
    try:
        await asyncio.wait_for(client.rollouts.remove_llm(url), UNREGISTER_TIMEOUT_S)
    except NotFound:
        pass  # never registered (registering failed or was cancelled)
    except (CorralError, TimeoutError) as err:
        print(f"corral run: could not remove {url} from the daemon's LLM servers: {err!r}", file=sys.stderr)


@contextlib.asynccontextmanager
async def _builtin_server(name: str, tasks: list, checkpoint: str | None) -> AsyncIterator[str]:
    from corral.rollout.reference.server import ReferenceServer

    policy: Policy
    if name == "builtin:replay":
        from corral.rollout.reference.replay import ReplayPolicy

        policy = ReplayPolicy(tasks)
    else:
        from corral.rollout.reference.tiny import TinyPolicy

        policy = TinyPolicy(checkpoint=checkpoint)
    server = ReferenceServer(policy)
    url = await server.start()
    try:
        yield url
    finally:
        await server.stop()


async def _collect(
    client: AsyncClient, tasks: list, args: argparse.Namespace, out: TextIO | None, show_progress: bool
) -> tuple[list[RolloutResult], float]:
    """The results in completion order, and the wall time it took."""
    results: list[RolloutResult] = []
    total = len(tasks) * args.samples
    started = time.monotonic()
    progress = _StageProgress(client, total) if show_progress else None
    async with progress or contextlib.nullcontext():
        async for result in client.rollouts.stream(tasks, n=args.samples, max_staleness=args.max_staleness):
            results.append(result)
            if out is not None:
                out.write(json.dumps(result_to_dict(result), ensure_ascii=False) + "\n")
                out.flush()
            if progress is not None:
                progress.finished(len(results))
    return results, time.monotonic() - started


class _StageProgress:
    """A rich progress bar per stage, fed by polling GetRolloutStats (the stages are in the
    daemon; the client only sees results)."""

    def __init__(self, client: AsyncClient, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._client = client
        self._progress = Progress(
            TextColumn("{task.description:<8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            transient=False,
        )
        self._bars = {stage: self._progress.add_task(stage.upper(), total=total, detail="") for stage in STAGES}
        self._done = self._progress.add_task("results", total=total, detail="")
        self._baseline: dict[str, int] = {}
        self._poller: asyncio.Task | None = None

    async def __aenter__(self) -> _StageProgress:
        stats = await self._client.rollouts.stats()
        self._baseline = {stage: getattr(stats, stage).completed for stage in STAGES}
        self._progress.start()
        self._poller = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller
        with contextlib.suppress(Exception):
            await self._refresh()
        self._progress.stop()

    def finished(self, count: int) -> None:
        self._progress.update(self._done, completed=count)

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self._refresh()
            await asyncio.sleep(0.25)

    async def _refresh(self) -> None:
        stats = await self._client.rollouts.stats()
        for stage in STAGES:
            stage_stats = getattr(stats, stage)
            self._progress.update(
                self._bars[stage],
                completed=stage_stats.completed - self._baseline[stage],
                detail=f"queued {stage_stats.queued:>3}  running {stage_stats.in_flight:>3}",
            )


def result_to_dict(result: RolloutResult) -> dict[str, Any]:
    """A result as JSON-ready values (eval_output as text)."""
    data = asdict(result)
    data["eval_output"] = result.eval_output.decode(errors="replace")
    return data


def is_token_exact(result: RolloutResult) -> bool:
    """The response is exactly the turns' generated and appended ids, in order, and every
    per-token list lines up with it."""
    rebuilt: list[int] = []
    mask: list[int] = []
    for turn in result.turns:
        rebuilt += turn.generated_ids + turn.observation_ids
        mask += [1] * len(turn.generated_ids) + [0] * len(turn.observation_ids)
    n = len(result.response_ids)
    return (
        rebuilt == result.response_ids
        and mask == result.response_mask
        and len(result.response_logprobs) == n
        and len(result.weight_versions) == n
    )


@dataclass
class Summary:
    total: int
    completed: int
    filtered: Counter = field(default_factory=Counter)
    cancelled: int = 0
    mean_reward: float = 0.0
    solved: int = 0
    token_exact: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    turns: list[int] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)
    init_shared: int = 0  # rollouts forked from an INIT shared with others (INIT once)
    init_fell_back: int = 0  # rollouts meant to share an INIT whose backend could not fork
    # Where evaluations ran: "snapshot_fork", "new" (clean sandboxes), "in_place".
    eval_sandboxes: Counter = field(default_factory=Counter)
    stage_seconds: dict[str, list[float]] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def rollouts_per_s(self) -> float:
        return self.total / self.wall_s if self.wall_s else 0.0


def summarize(results: Sequence[RolloutResult], wall_s: float = 0.0) -> Summary:
    completed = [r for r in results if r.status == "completed"]
    summary = Summary(total=len(results), completed=len(completed), wall_s=wall_s)
    summary.filtered = Counter(r.filter_reason or "unspecified" for r in results if r.status == "filtered")
    summary.cancelled = sum(r.status == "cancelled" for r in results)
    if completed:
        summary.mean_reward = statistics.fmean(r.reward for r in completed)
    summary.solved = sum(r.reward >= 1.0 for r in completed)
    summary.token_exact = sum(is_token_exact(r) for r in results)
    summary.finish_reasons = Counter(r.finish_reason or "none" for r in completed)
    summary.turns = [len(r.turns) for r in results]
    summary.response_tokens = [len(r.response_ids) for r in results]
    summary.init_shared = sum(r.init_shared_by > 0 for r in results)
    summary.init_fell_back = sum(r.init_fell_back for r in results)
    summary.eval_sandboxes = Counter(r.eval_sandbox for r in results if r.eval_sandbox != "unspecified")
    for name in ("init_queue", "init", "fork", "run_queue", "run", "eval_queue", "eval", "eval_sandbox", "total"):
        summary.stage_seconds[name] = [r.timings[name] for r in results]
    return summary


EVAL_SANDBOX_NAMES = {"snapshot_fork": "snapshot fork", "new": "new sandbox", "in_place": "the agent's sandbox"}


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def print_summary(summary: Summary, file: TextIO | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout)
    overview = Table(title="rollouts", show_header=False)
    overview.add_row("rollouts", str(summary.total))
    overview.add_row("completed", str(summary.completed))
    overview.add_row("filtered", ", ".join(f"{reason} {count}" for reason, count in summary.filtered.items()) or "0")
    overview.add_row("cancelled", str(summary.cancelled))
    overview.add_row("mean reward (completed)", f"{summary.mean_reward:.3f}")
    overview.add_row("reward 1.0", f"{summary.solved} of {summary.completed}")
    overview.add_row("token-exact trajectories", f"{summary.token_exact} of {summary.total}")
    overview.add_row("finish reasons", ", ".join(f"{k} {v}" for k, v in summary.finish_reasons.items()) or "-")
    overview.add_row("turns (mean / max)", _mean_max(summary.turns))
    overview.add_row("response tokens (mean / max)", _mean_max(summary.response_tokens))
    overview.add_row("INIT once", f"{summary.init_shared} forked, {summary.init_fell_back} fell back")
    overview.add_row(
        "evaluated in",
        ", ".join(f"{EVAL_SANDBOX_NAMES.get(k, k)} {v}" for k, v in sorted(summary.eval_sandboxes.items())) or "-",
    )
    overview.add_row("throughput", f"{summary.rollouts_per_s:.2f} rollouts/s over {summary.wall_s:.1f} s")
    console.print(overview)
    stages = Table(title="stage time (s)")
    for column in ("stage", "p50", "p90", "p99", "max"):
        stages.add_column(column, justify="right" if column != "stage" else "left")
    for name, values in summary.stage_seconds.items():
        stages.add_row(name, *(f"{percentile(values, q):.3f}" for q in (0.5, 0.9, 0.99, 1.0)))
    console.print(stages)


def _mean_max(values: Sequence[int]) -> str:
    if not values:
        return "-"
    return f"{statistics.fmean(values):.1f} / {max(values)}"
