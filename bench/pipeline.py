"""Streaming rollouts against a synchronous batch loop: rollouts per second and the trainer's idle time.

One process runs an embedded daemon (local sandboxes), the built-in reference LLM server (replay
policy, `--latency-ms` slept per generate request) and a simulated trainer, and puts the same
task mix through it two ways:
  streaming  one RolloutService stream with up to G rollouts in flight; each finished rollout
             is replaced at once (while the lag bound allows, below). The trainer takes a batch
             as soon as B results are there and trains on it while rollouts go on.
  batch      the usual synchronous loop: G rollouts submitted together, the trainer waits for the
             whole group (its slowest rollout), trains on it in G/B steps, then submits the next.
Both have the same G rollouts at most in flight (the same generation capacity), the same
tasks in the same order, the same training cost: one step of B rollouts is `B * --train-ms`
of CPU-free waiting (asyncio.sleep, a GPU step). Streaming bounds how far generation runs
ahead of training as AReaL does: a rollout is submitted only while
submitted < (steps done + 1 + --max-lag) * B.

The tasks: a one-file repair (`add` subtracts) whose reference solution is k `echo step i`
shell calls, the fix, and submit (k + 2 turns, one LLM request each), k + 2 long-tailed:
int(2 * Pareto(--alpha)), capped at --max-turns, drawn with a fixed --seed. Every
rollout must complete with reward 1.0, finish "submitted" and have its k + 2 turns; the
script fails otherwise.

Measured per mode: rollouts per second (rollouts trained / wall time, from the first
submission to the end of the last training step), the trainer's idle fraction (time spent
waiting for results / wall time), rollout latency (submission to result, in the client) p50
and p99, the share of the G generation slots that were busy, and (streaming) how many
training steps a rollout's result lagged behind the step it was submitted at. Modes alternate
in --rounds rounds over the same task list; the figures pool all rounds.

Usage: python bench/pipeline.py [--quick] [--json PATH] [--tasks N] [--latency-ms X] [--group G]
       [--batch B] [--train-ms X] [--max-lag S] [--alpha A] [--max-turns T] [--rounds R] [--seed S]
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from _common import parse_args, percentile, print_header, summary, write_json

GOAL_RATIO, GOAL_IDLE = 2.0, 0.10


def options(parser) -> None:
    parser.add_argument("--tasks", type=int, help="tasks per round (a multiple of --group; default 384, quick 96)")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="simulated LLM latency per request")
    parser.add_argument("--group", type=int, default=8, help="G: rollouts in flight; the batch loop's group")
    parser.add_argument("--batch", type=int, default=8, help="B: rollouts per training step (divides G)")
    parser.add_argument("--train-ms", type=float, default=100.0, help="training cost per rollout (a step: B times it)")
    parser.add_argument("--max-lag", type=int, default=2, help="streaming: steps generation may run ahead")
    parser.add_argument("--alpha", type=float, default=1.2, help="Pareto shape of the turns (smaller: longer tail)")
    parser.add_argument("--max-turns", type=int, default=50, help="turns of the longest task")
    parser.add_argument("--rounds", type=int, help="rounds of (streaming, batch) (default 2, quick 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task mix and its order")


# ---- the tasks ----------------------------------------------------------------------------------


def draw_turns(count: int, alpha: float, max_turns: int, seed: int) -> list[int]:
    """Turns per task: int(2 * Pareto(alpha)) (at least 2), at most max_turns: many short, a few long."""
    rng = random.Random(seed)
    return [min(int(2 * rng.paretovariate(alpha)), max_turns) for _ in range(count)]


def make_task(task_id: str, turns: int):
    """A one-file repair task solved in `turns` turns: turns - 2 echoes, the fix, submit."""
    from corral.v1 import rollout_pb2 as pb

    def call(name: str, **arguments: object) -> pb.ToolCall:
        return pb.ToolCall(name=name, arguments_json=json.dumps(arguments))

    task = pb.Task(task_id=task_id, limits=pb.TaskLimits(max_turns=turns + 2))
    task.setup.files.add(path="calc.py", content=b"def add(a, b):\n    return a - b\n")
    task.prompt.messages.add(role="system", content="You repair Python code.")
    # The task id in the first user message lets the replay policy tell the tasks apart.
    task.prompt.messages.add(role="user", content=f"[{task_id}] add() in calc.py is wrong; fix it.")
    task.evaluation.files.add(path="check.py", content=b"import calc\nassert calc.add(2, 3) == 5\n")
    task.evaluation.commands.append("python3 check.py")
    task.evaluation.exit_status.SetInParent()
    task.reference_solution.extend(call("bash", command=f"echo step {i}") for i in range(turns - 2))
    task.reference_solution.append(
        call("editor", command="str_replace", path="calc.py", old_str="a - b", new_str="a + b")
    )
    task.reference_solution.append(call("submit"))
    return task


# ---- one run of a mode --------------------------------------------------------------------------


@dataclass
class Run:
    mode: str
    wall_s: float = 0.0
    idle_s: float = 0.0
    # Waiting for the first batch, and waiting after the last task went in (the pipeline's fill
    # and drain, which a longer run amortises).
    idle_first_s: float = 0.0
    idle_drain_s: float = 0.0
    # Streaming: seconds from the start to the last submission (the steady part ends there).
    last_submission_s: float = 0.0
    steps: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)
    busy_s: float = 0.0

    def as_dict(self, group: int) -> dict:
        return {
            "rollouts": len(self.latencies_ms),
            "wall_s": round(self.wall_s, 3),
            "idle_s": round(self.idle_s, 3),
            "idle_first_batch_s": round(self.idle_first_s, 3),
            "idle_drain_s": round(self.idle_drain_s, 3),
            "steps": self.steps,
            "rollouts_per_s": round(len(self.latencies_ms) / self.wall_s, 3),
            "consumer_idle_fraction": round(self.idle_s / self.wall_s, 4),
            "slots_busy_fraction": round(self.busy_s / (group * self.wall_s), 4),
        }


class RolloutFailed(RuntimeError):
    """A rollout did not replay its reference solution to reward 1.0: the benchmark is void."""


def check(result, expected_turns: dict[str, int]) -> None:
    """Fails loudly on any rollout that did not replay its solution to reward 1.0."""
    turns = expected_turns[result.task_id]
    if (
        result.status != "completed"
        or result.reward != 1.0
        or result.finish_reason != "submitted"
        or len(result.turns) != turns
    ):
        raise RolloutFailed(
            f"rollout {result.rollout_id} of {result.task_id}: status {result.status}, reward "
            f"{result.reward}, finish {result.finish_reason}, {len(result.turns)} of {turns} turns, "
            f"filter {result.filter_reason}: {result.error or result.eval_output[-300:]!r}"
        )


async def train(batch_size: int, train_ms: float) -> None:
    """One training step on `batch_size` results: CPU-free, as a step on a GPU would be."""
    await asyncio.sleep(batch_size * train_ms / 1000)


@dataclass
class _StreamState:
    in_flight: int = 0
    steps: int = 0  # training steps done
    all_submitted_at: float | None = None


async def run_streaming(client, tasks: list, expected: dict[str, int], p) -> Run:
    run = Run("streaming")
    buffer: list[tuple[object, int]] = []  # (result, steps done when it was submitted)
    submitted_at: dict[str, tuple[float, int]] = {}  # rollout key -> (time, steps done)
    changed = asyncio.Event()  # a result arrived or a step ended
    state = _StreamState()
    t0 = time.perf_counter()

    async with client.rollouts.open_stream() as stream:

        async def submit_all() -> None:
            for i, task in enumerate(tasks):
                while not (state.in_flight < p.group and i < (state.steps + 1 + p.max_lag) * p.batch):
                    changed.clear()
                    await changed.wait()
                state.in_flight += 1
                submitted_at[task.task_id] = (time.perf_counter(), state.steps)
                await stream.submit(task)
            state.all_submitted_at = time.perf_counter()
            run.last_submission_s = state.all_submitted_at - t0
            await stream.close_input()

        async def read_all() -> None:
            async for result in stream:
                now = time.perf_counter()
                check(result, expected)
                started, step = submitted_at.pop(result.task_id)
                run.latencies_ms.append((now - started) * 1000)
                run.busy_s += now - started
                buffer.append((result, step))
                state.in_flight -= 1
                changed.set()

        async def consume() -> None:
            trained = 0
            while trained < len(tasks):
                waited = time.perf_counter()
                while len(buffer) < p.batch:
                    changed.clear()
                    await changed.wait()
                now = time.perf_counter()
                run.idle_s += now - waited
                if trained == 0:
                    run.idle_first_s = now - waited
                elif state.all_submitted_at is not None:
                    run.idle_drain_s += now - max(waited, state.all_submitted_at)
                batch, buffer[:] = buffer[: p.batch], buffer[p.batch :]
                run.lags += [state.steps - step for _, step in batch]
                await train(p.batch, p.train_ms)
                trained += p.batch
                state.steps += 1
                run.steps += 1
                changed.set()

        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(submit_all())
                group.create_task(read_all())
                group.create_task(consume())
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
    run.wall_s = time.perf_counter() - t0
    return run


async def run_batch(client, tasks: list, expected: dict[str, int], p) -> Run:
    run = Run("batch")
    t0 = time.perf_counter()
    async with client.rollouts.open_stream() as stream:
        for first in range(0, len(tasks), p.group):
            waited = time.perf_counter()
            submitted_at = {}
            for task in tasks[first : first + p.group]:
                submitted_at[task.task_id] = time.perf_counter()
                await stream.submit(task)
            results: list[object] = []
            while len(results) < len(submitted_at):
                result = await anext(stream)
                now = time.perf_counter()
                check(result, expected)
                run.latencies_ms.append((now - submitted_at[result.task_id]) * 1000)
                run.busy_s += now - submitted_at[result.task_id]
                results.append(result)
            run.idle_s += time.perf_counter() - waited
            if first == 0:
                run.idle_first_s = run.idle_s
            for _ in range(p.group // p.batch):
                await train(p.batch, p.train_ms)
                run.lags += [0] * p.batch
                run.steps += 1
        await stream.close_input()
    run.wall_s = time.perf_counter() - t0
    return run


# ---- main ---------------------------------------------------------------------------------------


def pooled(runs: list[Run], group: int) -> dict:
    wall = sum(r.wall_s for r in runs)
    latencies = [x for r in runs for x in r.latencies_ms]
    lags = [x for r in runs for x in r.lags]
    return {
        **summary(latencies),
        "rollouts_per_s": round(len(latencies) / wall, 3),
        "consumer_idle_fraction": round(sum(r.idle_s for r in runs) / wall, 4),
        "slots_busy_fraction": round(sum(r.busy_s for r in runs) / (group * wall), 4),
        "wall_s": round(wall, 3),
        "steps": sum(r.steps for r in runs),
        "lag_mean_steps": round(statistics.fmean(lags), 3),
        "lag_max_steps": max(lags),
        "idle_first_batch_s": round(sum(r.idle_first_s for r in runs), 3),
        "idle_drain_s": round(sum(r.idle_drain_s for r in runs), 3),
        **steady_idle(runs),
        "rounds": [r.as_dict(group) for r in runs],
    }


def steady_idle(runs: list[Run]) -> dict:
    """Streaming: the idle fraction between the first batch and the last submission, the fill and
    drain of a finite run left out (what a run that never ends would see)."""
    if not all(r.last_submission_s for r in runs):
        return {}
    window = sum(r.last_submission_s - r.idle_first_s for r in runs)
    idle = sum(r.idle_s - r.idle_first_s - r.idle_drain_s for r in runs)
    return {"consumer_idle_fraction_steady": round(idle / window, 4)}


async def measure(p, tasks: list, expected: dict[str, int], warmup: list) -> dict[str, list[Run]]:
    from corral.daemon.embedded import embedded_daemon
    from corral.rollout.reference.replay import ReplayPolicy
    from corral.rollout.reference.server import ReferenceServer
    from corral.sdk import AsyncClient

    server = ReferenceServer(ReplayPolicy(tasks + warmup), latency_s=p.latency_ms / 1000)
    await server.start()
    runs: dict[str, list[Run]] = {"streaming": [], "batch": []}
    try:
        async with embedded_daemon() as address, AsyncClient(address) as client:
            await client.rollouts.register_llm(server.url)
            # Untimed: the first sandboxes, connections and code paths.
            async for result in client.rollouts.stream(warmup):
                check(result, expected)
            for number in range(1, p.rounds + 1):
                for mode, fn in (("streaming", run_streaming), ("batch", run_batch)):
                    run = await fn(client, tasks, expected, p)
                    runs[mode].append(run)
                    d = run.as_dict(p.group)
                    print(
                        f"  round {number} {mode:<9}  {d['rollouts_per_s']:7.2f} rollouts/s, wall "
                        f"{d['wall_s']:6.2f} s, consumer idle {100 * d['consumer_idle_fraction']:5.1f}%",
                        flush=True,
                    )
    finally:
        await server.stop()
    return runs


def main() -> None:
    p = parse_args(__doc__.split("\n")[0], options)
    p.tasks = p.tasks or (96 if p.quick else 384)
    p.rounds = p.rounds or (1 if p.quick else 2)
    if p.group % p.batch or p.tasks % p.group or p.max_turns < 2:
        raise SystemExit("--batch must divide --group, --group must divide --tasks, and --max-turns be at least 2")

    turns = draw_turns(p.tasks, p.alpha, p.max_turns, p.seed)
    tasks = [make_task(f"pipe-{i:04d}", t) for i, t in enumerate(turns)]
    warmup = [make_task(f"warm-{i}", 3) for i in range(p.group)]
    expected = {t.task_id: len(t.reference_solution) for t in tasks + warmup}
    ordered = sorted(turns)
    mix = {
        "turns_mean": round(statistics.fmean(turns), 2),
        "turns_p50": percentile(ordered, 50),
        "turns_p90": percentile(ordered, 90),
        "turns_max": max(turns),
        "llm_requests": sum(turns),
    }
    params = {
        "tasks_per_round": p.tasks,
        "rounds": p.rounds,
        "latency_ms": p.latency_ms,
        "group": p.group,
        "batch": p.batch,
        "train_ms_per_rollout": p.train_ms,
        "train_step_ms": p.batch * p.train_ms,
        "max_lag": p.max_lag,
        "alpha": p.alpha,
        "max_turns": p.max_turns,
        "seed": p.seed,
        "backend": "local",
    }

    print_header(f"streaming pipeline vs synchronous batches: {p.tasks} tasks x {p.rounds} round(s) per mode")
    print(
        f"  LLM latency {p.latency_ms:g} ms/request; G={p.group} in flight; B={p.batch} per step of "
        f"{p.batch * p.train_ms:g} ms ({p.train_ms:g} ms/rollout); max lag {p.max_lag} steps"
    )
    print(
        f"  turns per task: mean {mix['turns_mean']}, p50 {mix['turns_p50']:g}, p90 {mix['turns_p90']:g}, "
        f"max {mix['turns_max']} (Pareto alpha {p.alpha}, seed {p.seed}); {mix['llm_requests']} LLM requests a round"
    )
    try:
        runs = asyncio.run(measure(p, tasks, expected, warmup))
    except RolloutFailed as failed:
        raise SystemExit(f"FAILED: {failed}") from None

    results = {mode: pooled(r, p.group) for mode, r in runs.items()}
    s, b = results["streaming"], results["batch"]
    ratio = round(s["rollouts_per_s"] / b["rollouts_per_s"], 2)
    ratio_values = {"rollouts_per_s:streaming/batch": ratio, "p50:streaming/batch": round(s["p50_ms"] / b["p50_ms"], 2)}
    met = ratio >= GOAL_RATIO and s["consumer_idle_fraction"] < GOAL_IDLE

    print(
        f"\n  {'variant':<10}  {'rollouts/s':>10}  {'idle':>6}  {'p50 ms':>8}  {'p99 ms':>8}  {'n':>5}  "
        f"{'wall s':>7}  {'slots':>6}  {'lag mean/max':>12}"
    )
    for name, r in results.items():
        print(
            f"  {name:<10}  {r['rollouts_per_s']:>10.2f}  {100 * r['consumer_idle_fraction']:>5.1f}%  "
            f"{r['p50_ms']:>8.1f}  {r['p99_ms']:>8.1f}  {r['n']:>5}  {r['wall_s']:>7.2f}  "
            f"{100 * r['slots_busy_fraction']:>5.1f}%  {r['lag_mean_steps']:>7.2f}/{r['lag_max_steps']:<4}"
        )
    print(
        f"  streaming idle: {s['idle_first_batch_s']:.2f} s before the first batch, {s['idle_drain_s']:.2f} s "
        f"after the last submission, {100 * s['consumer_idle_fraction_steady']:.1f}% of the time in between"
    )
    print(
        f"  ratio rollouts/s streaming/batch = {ratio:.2f}x; goal (>= {GOAL_RATIO:g}x with the streaming "
        f"consumer idle < {100 * GOAL_IDLE:g}%): {'met' if met else 'NOT met'}"
    )
    write_json(
        p.json,
        results,
        ratio_values,
        {
            "parameters": params,
            "task_mix": mix,
            "goal": {"ratio_at_least": GOAL_RATIO, "idle_below": GOAL_IDLE, "met": met},
        },
    )


if __name__ == "__main__":
    main()
