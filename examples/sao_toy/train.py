"""SAO on a toy tool-use task, online, against synchronous GRPO: both from the same warm start,
for the same wall-clock budget, on two CPU cores.

Everything is real and in one process: an embedded corral daemon (local sandboxes) runs the
rollouts; the built-in reference LLM server serves a byte-level GRU policy (`TinyPolicy`); after
every update the learner saves the weights, the server loads them (POST /update_weights_from_disk
with weight_version = the learner's version) and the daemon is told the new policy version
(`set_policy_version`). Each generated token carries the version that produced it, so the
staleness the learner sees is real.

The task set (tasks.py): six one-line repairs of calc.py, each fixed by a sed command that depends
on the prompt, graded by a hidden check's exit status.

  warm start  behaviour cloning on the reference replies with label smoothing (warm_start.py),
              until the greedy reply is right for every variant: the policy reads the prompt,
              but at temperature 1 most replies have a typo (reward ~0.2). Both modes start
              from that checkpoint. Not counted in the budget.
  sao         corral's StreamingLearner with the SAO loss (CODING preset): one rollout per prompt,
              `--in-flight` rollouts kept running, an update as soon as `--batch` results are in,
              advantage = reward - per-task running baseline (seeded with the warm start's
              measured reward). The learner's optimiser step runs in a worker thread, so
              rollouts keep going while it trains; new rollouts are submitted only while
              submitted < (updates + 1 + --max-lag) * batch, which bounds the staleness of
              all but the slowest rollouts (one that takes long falls further behind).
  grpo        the synchronous group barrier: batch / `--group-size` prompts x `--group-size`
              samples submitted together, wait for all, group-normalised advantages, PPO/DAPO clipped loss, one
              update, push the weights, repeat. Staleness is 0 by construction.

Both modes use the same network, optimiser (Adam, --lr), loss aggregation (--denominator
sequence), logprob function, daemon worker counts and batch size. After the budget each mode's
final policy is evaluated on --eval-rollouts fresh rollouts (temperature 1), as is the warm
start before either.

Writes to --out: sao_toy_<mode>.json (one record per update: wall-clock seconds, mean reward of
the rollouts trained on, its moving average over the last --window rollouts, staleness mean/max,
masked or clipped fraction, ...), sao_toy.json (the summary of the whole run) and sao_toy.png
(reward against wall-clock seconds, both modes; needs matplotlib, else only the JSON is written).

Usage: python examples/sao_toy/train.py [--minutes 15] [--out runs/] [--mode both|sao|grpo]
       [--seed 0] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import aiohttp  # noqa: E402
import torch  # noqa: E402
from network import SharedPrefixLogprobs, common_prefix, load_checkpoint, save_checkpoint  # noqa: E402
from tasks import VARIANTS, Variant, make_task, prompt_ids  # noqa: E402
from warm_start import WarmStart, exact_probabilities, warm_start  # noqa: E402

from corral.daemon.embedded import embedded_daemon  # noqa: E402
from corral.rollout.reference.server import ReferenceServer  # noqa: E402
from corral.rollout.reference.tiny import TinyPolicy  # noqa: E402
from corral.sdk import AsyncClient  # noqa: E402
from corral.trainer_adapters.sao import (  # noqa: E402
    CODING,
    LearnerConfig,
    StreamingLearner,
    clipped_policy_loss,
    group_normalized_advantages,
    sequence_advantages_to_tokens,
)
from corral.trainer_adapters.sao.loss import Denominator  # noqa: E402

GOAL_REWARD = 0.8


@dataclass
class Settings:
    minutes: float = 15.0
    seed: int = 0
    lr: float = 3e-4
    optimizer: str = "adam"  # adam or sgd, both modes
    baseline_momentum: float = 0.9  # SAO: the per-task running baseline
    # Loss aggregation, both modes (see trainer_adapters/sao/loss.py): "sequence" weighs every
    # rollout equally; "token" lets long failed rollouts outweigh short successes (see README).
    denominator: Denominator = "sequence"
    batch: int = 8  # rollouts per update, both modes
    in_flight: int = 4  # SAO: rollouts kept running
    max_lag: int = 2  # SAO: updates generation may run ahead of training
    group_size: int = 4  # GRPO: samples per prompt; groups = batch / group_size
    workers: int = 4  # daemon init/run/eval workers, both modes
    max_turns: int = 2
    max_new_tokens: int = 48
    temperature: float = 1.0
    window: int = 64  # moving average over this many rollouts
    eval_rollouts: int = 96  # each evaluation (a multiple of 6 tells every variant equally)
    warm_smoothing: float = 0.05
    warm_max_steps: int = 800
    warm_lr: float = 3e-3
    max_updates: int | None = None

    @property
    def groups(self) -> int:
        return max(self.batch // self.group_size, 1)

    def task(self, variant: Variant) -> Any:
        """The rollout task of `variant` with this run's turn, token and temperature settings."""
        return make_task(
            variant, max_turns=self.max_turns, max_new_tokens=self.max_new_tokens, temperature=self.temperature
        )


def smoke_settings(seed: int) -> Settings:
    """A short run for the test: a few updates per mode, a handful of evaluation rollouts."""
    return Settings(
        minutes=0.25,
        seed=seed,
        batch=4,
        in_flight=2,
        group_size=2,
        workers=2,
        window=8,
        eval_rollouts=6,
        warm_max_steps=40,
        max_updates=3,
    )


def make_optimizer(model: torch.nn.Module, settings: Settings) -> torch.optim.Optimizer:
    if settings.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=settings.lr)


# ---- shared pieces --------------------------------------------------------------------------------


class MovingAverage:
    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def add(self, values: list[float]) -> float:
        self.values.extend(values)
        return statistics.fmean(self.values)

    @property
    def full(self) -> bool:
        return len(self.values) == self.values.maxlen


def staleness_of(result: Any, version: int) -> list[int]:
    """Per generated token: the learner's version minus the version that generated it."""
    return [version - v for m, v in zip(result.response_mask, result.weight_versions) if m]


class Session:
    """One mode's daemon, reference server and bookkeeping; also pushes weights."""

    def __init__(self, name: str, settings: Settings, checkpoint: Path, workdir: Path) -> None:
        self.name = name
        self.settings = settings
        self.workdir = workdir
        self.weights_path = workdir / f"{name}-policy.pt"
        self.policy = TinyPolicy(model=load_checkpoint(checkpoint), seed=settings.seed, weight_version=0)
        self.server = ReferenceServer(self.policy)
        self.url = ""
        self._client: AsyncClient | None = None
        self._http: aiohttp.ClientSession | None = None
        self.pushes = 0
        self.push_seconds = 0.0

    def connect(self, client: AsyncClient, http: aiohttp.ClientSession) -> None:
        self._client, self._http = client, http

    @property
    def client(self) -> AsyncClient:
        """The daemon's client, while `with_session` runs."""
        assert self._client is not None, "the session is not connected"
        return self._client

    @property
    def http(self) -> aiohttp.ClientSession:
        """The HTTP session to the reference server, while `with_session` runs."""
        assert self._http is not None, "the session is not connected"
        return self._http

    async def push(self, model: torch.nn.Module, version: int) -> None:
        """Save, load into the server under `version`, tell the daemon."""
        started = time.monotonic()
        await asyncio.to_thread(save_checkpoint, model, self.weights_path)
        async with self.http.post(
            f"{self.url}/update_weights_from_disk",
            json={"model_path": str(self.weights_path), "weight_version": version},
        ) as response:
            body = await response.json()
        if response.status != 200 or not body.get("success"):
            raise RuntimeError(f"the server refused the weights of version {version}: {body}")
        await self.client.rollouts.set_policy_version(version)
        self.pushes += 1
        self.push_seconds += time.monotonic() - started

    async def server_weight_version(self) -> int:
        async with self.http.get(f"{self.url}/get_weight_version") as response:
            return int((await response.json())["weight_version"])


@dataclass
class ModeResult:
    mode: str
    updates: list[dict]
    rollouts: list[dict]
    budget_s: float
    wall_s: float = 0.0
    final_eval: dict | None = None
    server_weight_version: int = 0
    daemon_policy_version: int = 0
    pushes: int = 0
    push_seconds: float = 0.0
    filtered: int = 0
    prompt_check: bool | None = None
    # The machine's 1-minute load average when the mode started and ended (the cores may be shared).
    load_average: tuple[float, float] = (0.0, 0.0)

    def accept(self, item: Any) -> bool:
        """Whether a result is trained on: filtered ones are only counted; the first completed
        one also checks the daemon's prompt ids."""
        if item.status != "completed":
            self.filtered += 1
            return False
        if self.prompt_check is None:
            self.prompt_check = check_prompt(item)
        return True

    def summary(self, window: int) -> dict:
        rewards = [r["reward"] for r in self.rollouts]
        first = rewards[:window]
        last = rewards[-window:]
        reached = next((u["t"] for u in self.updates if u["window_full"] and u["reward_ma"] >= GOAL_REWARD), None)
        staleness_means = [u["staleness_mean"] for u in self.updates]
        return {
            "mode": self.mode,
            "budget_s": self.budget_s,
            "wall_s": round(self.wall_s, 1),
            "updates": len(self.updates),
            "rollouts_trained": len(self.rollouts),
            "rollouts_filtered": self.filtered,
            "rollouts_per_s": round(len(self.rollouts) / self.wall_s, 3) if self.wall_s else 0.0,
            "reward_first_window": round(statistics.fmean(first), 4) if first else None,
            "reward_last_window": round(statistics.fmean(last), 4) if last else None,
            "seconds_to_goal": reached,
            "goal_reward": GOAL_REWARD,
            "staleness_mean": round(statistics.fmean(staleness_means), 3) if staleness_means else 0.0,
            "staleness_max": max((u["staleness_max"] for u in self.updates), default=0),
            "masked_fraction_mean": round(statistics.fmean(u["masked_fraction"] for u in self.updates), 4)
            if self.updates
            else 0.0,
            "final_eval": self.final_eval,
            "server_weight_version": self.server_weight_version,
            "daemon_policy_version": self.daemon_policy_version,
            "weight_pushes": self.pushes,
            "push_seconds_total": round(self.push_seconds, 2),
            "prompt_ids_match": self.prompt_check,
            # The newest weight version that generated a trained-on rollout: > 0 once pushed weights were served.
            "max_generation_version": max((r["version"] for r in self.rollouts), default=-1),
            "load_average_start_end": [round(x, 2) for x in self.load_average],
        }


def rollout_record(result: Any, t: float, version: int) -> dict:
    """One trained-on rollout: when it was taken (seconds into the budget), its reward, the oldest
    weight version among its generated tokens, and its staleness against the learner's `version`."""
    stale = staleness_of(result, version)
    generated_by = [v for m, v in zip(result.response_mask, result.weight_versions) if m]
    return {
        "t": round(t, 3),
        "task": result.task_id,
        "reward": result.reward,
        "version": min(generated_by, default=-1),
        "turns": len(result.turns),
        "generated": len(stale),
        "staleness_max": max(stale, default=0),
        "finish": result.finish_reason,
    }


def check_prompt(result: Any) -> bool:
    """Whether the daemon's prompt ids are those tasks.prompt_ids builds (what the warm start
    trained on)."""
    variant = next(v for v in VARIANTS if v.name == result.task_id)
    return list(result.prompt_ids) == prompt_ids(variant)


# ---- SAO: streaming -------------------------------------------------------------------------------


async def run_sao(
    session: Session,
    model: torch.nn.Module,
    logprobs: SharedPrefixLogprobs,
    settings: Settings,
    rng: random.Random,
    start_reward: float | None,
) -> ModeResult:
    client = session.client
    budget = settings.minutes * 60
    result = ModeResult("sao", [], [], budget)
    changed = asyncio.Event()
    average = MovingAverage(settings.window)
    optimizer = make_optimizer(model, settings)
    t0 = time.monotonic()
    trained_batch: list[dict] = []

    async def publish(version: int) -> None:
        await session.push(model, version)

    # Every task's running baseline starts at the warm start's measured success rate: from 0, the
    # first successes of each task would look far better than they are.
    learner = StreamingLearner(
        model,
        optimizer,
        logprobs,
        config=LearnerConfig(
            batch_rollouts=settings.batch,
            loss=dataclasses.replace(CODING, denominator=settings.denominator),
            baseline_momentum=settings.baseline_momentum,
            baseline_initial=start_reward or 0.0,
        ),
        publish=publish,
    )
    results: asyncio.Queue = asyncio.Queue()
    state = {"submitted": 0, "in_flight": 0, "stop": False}

    async def learn() -> None:
        """Takes results as they come and updates when a batch is ready. `learner.update()` runs
        the optimiser step in a worker thread, so the stream, the daemon and the server on this
        loop keep going while it trains."""
        while (item := await results.get()) is not None:
            if not any(item.response_mask):  # nothing generated: the learner skips it too
                learner.add(item)
                continue
            # The staleness of each rollout as the learner will see it (its version now).
            trained_batch.append(rollout_record(item, time.monotonic() - t0, learner.policy_version))
            if not learner.add(item):
                continue
            report = await learner.update()
            batch, trained_batch[:] = list(trained_batch), []
            record_update(
                result,
                report.version,
                time.monotonic() - t0,
                batch,
                average,
                staleness_mean=report.staleness_mean,
                staleness_max=report.staleness_max,
                masked_fraction=report.masked_fraction,
                loss=report.loss,
                tokens=report.tokens,
            )
            changed.set()
            if settings.max_updates is not None and len(result.updates) >= settings.max_updates:
                state["stop"] = True
                return

    learner_task = asyncio.create_task(learn())
    learner_task.add_done_callback(lambda _: changed.set())  # a failed learner stops the run

    def may_submit() -> bool:
        allowed = (len(result.updates) + 1 + settings.max_lag) * settings.batch
        return state["in_flight"] < settings.in_flight and state["submitted"] < allowed

    def time_left() -> float:
        return budget - (time.monotonic() - t0)

    async with client.rollouts.open_stream() as stream:

        async def submit() -> None:
            while not state["stop"] and time_left() > 0:
                if not may_submit():
                    changed.clear()
                    try:
                        await asyncio.wait_for(changed.wait(), timeout=max(time_left(), 0.01))
                    except TimeoutError:
                        pass
                    continue
                state["submitted"] += 1
                state["in_flight"] += 1
                await stream.submit(settings.task(rng.choice(VARIANTS)))

        async def read() -> None:
            async for item in stream:
                state["in_flight"] -= 1
                changed.set()
                if result.accept(item):
                    results.put_nowait(item)

        submitter = asyncio.create_task(submit())
        reader = asyncio.create_task(read())
        while not state["stop"] and time_left() > 0 and not reader.done() and not learner_task.done():
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), timeout=max(min(time_left(), 1.0), 0.01))
            except TimeoutError:
                pass
        submitter.cancel()
        reader.cancel()
        for task in (submitter, reader):
            try:
                await task
            except asyncio.CancelledError:
                pass
    # Leaving the stream cancelled what was in flight; an update under way finishes (and a
    # learner that failed raises here).
    results.put_nowait(None)
    await learner_task
    result.wall_s = time.monotonic() - t0
    return result


# ---- GRPO: synchronous group barrier ---------------------------------------------------------------


async def run_grpo(
    session: Session,
    model: torch.nn.Module,
    logprobs: SharedPrefixLogprobs,
    settings: Settings,
    rng: random.Random,
    start_reward: float | None,
) -> ModeResult:
    client = session.client
    budget = settings.minutes * 60
    result = ModeResult("grpo", [], [], budget)
    average = MovingAverage(settings.window)
    optimizer = make_optimizer(model, settings)
    version = 0
    t0 = time.monotonic()

    def step(batch: list[Any]) -> tuple[float, dict[str, float], int]:
        width = max(len(r.response_ids) for r in batch)
        old = torch.zeros(len(batch), width)
        mask = torch.zeros(len(batch), width)
        for row, r in enumerate(batch):
            old[row, : len(r.response_ids)] = torch.tensor(r.response_logprobs)
            mask[row, : len(r.response_ids)] = torch.tensor(r.response_mask, dtype=torch.float32)
        advantages = sequence_advantages_to_tokens(
            group_normalized_advantages([r.reward for r in batch], [r.group_id for r in batch]), mask
        )
        current = torch.nn.utils.rnn.pad_sequence(
            [logprobs(model, r.prompt_ids, r.response_ids) for r in batch], batch_first=True
        )
        loss, metrics = clipped_policy_loss(current, old, advantages, mask, denominator=settings.denominator)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(loss.detach()), metrics, int(mask.sum())

    async with client.rollouts.open_stream() as stream:
        while time.monotonic() - t0 < budget:
            for _ in range(settings.groups):
                await stream.submit(settings.task(rng.choice(VARIANTS)), n=settings.group_size)
            expected = settings.groups * settings.group_size
            batch, records = [], []
            timed_out = False
            for _ in range(expected):
                remaining = budget - (time.monotonic() - t0)
                try:
                    item = await asyncio.wait_for(anext(stream), timeout=max(remaining, 0.001))
                except TimeoutError:
                    timed_out = True
                    break
                if not result.accept(item):
                    continue
                batch.append(item)
                records.append(rollout_record(item, time.monotonic() - t0, version))
            if timed_out or not batch:
                break
            stale = [s for r in batch for s in staleness_of(r, version)]
            loss, metrics, tokens = await asyncio.to_thread(step, batch)
            version += 1
            await session.push(model, version)
            record_update(
                result,
                version,
                time.monotonic() - t0,
                records,
                average,
                staleness_mean=statistics.fmean(stale) if stale else 0.0,
                staleness_max=max(stale, default=0),
                masked_fraction=metrics["clip_fraction"],
                loss=loss,
                tokens=tokens,
            )
            if settings.max_updates is not None and len(result.updates) >= settings.max_updates:
                break
    result.wall_s = time.monotonic() - t0
    return result


def record_update(
    result: ModeResult,
    version: int,
    t: float,
    records: list[dict],
    average: MovingAverage,
    *,
    staleness_mean: float,
    staleness_max: int,
    masked_fraction: float,
    loss: float,
    tokens: int,
) -> None:
    rewards = [r["reward"] for r in records]
    moving = average.add(rewards)
    result.rollouts.extend(records)
    result.updates.append(
        {
            "version": version,
            "t": round(t, 3),
            "rollouts": len(records),
            "tokens": tokens,
            "reward": round(statistics.fmean(rewards), 4) if rewards else None,
            "reward_ma": round(moving, 4),
            "window_full": average.full,
            "staleness_mean": round(staleness_mean, 3),
            "staleness_max": staleness_max,
            "masked_fraction": round(masked_fraction, 4),
            "loss": round(loss, 5),
        }
    )


# ---- evaluation --------------------------------------------------------------------------------------


async def evaluate(session: Session, settings: Settings, count: int) -> dict:
    """`count` fresh rollouts of the served policy (variants in turn), no training."""
    tasks = [settings.task(VARIANTS[i % len(VARIANTS)]) for i in range(count)]
    per_variant: dict[str, list[float]] = {}
    filtered = 0
    async for item in session.client.rollouts.stream(tasks):
        if item.status != "completed":
            filtered += 1
            continue
        per_variant.setdefault(item.task_id, []).append(item.reward)
    rewards = [r for values in per_variant.values() for r in values]
    return {
        "rollouts": len(rewards),
        "filtered": filtered,
        "mean_reward": round(statistics.fmean(rewards), 4) if rewards else None,
        "per_variant": {k: round(statistics.fmean(v), 3) for k, v in sorted(per_variant.items())},
    }


async def with_session(name: str, settings: Settings, checkpoint: Path, workdir: Path, body) -> Any:
    session = Session(name, settings, checkpoint, workdir)
    session.url = await session.server.start()
    try:
        async with (
            embedded_daemon(
                init_workers=settings.workers, run_workers=settings.workers, eval_workers=settings.workers
            ) as address,
            AsyncClient(address) as client,
            aiohttp.ClientSession() as http,
        ):
            session.connect(client, http)
            await client.rollouts.register_llm(session.url)
            return await body(session)
    finally:
        await session.server.stop()


async def run_mode(
    mode: str, settings: Settings, checkpoint: Path, workdir: Path, start_reward: float | None = None
) -> ModeResult:
    async def body(session: Session) -> ModeResult:
        torch.manual_seed(settings.seed)
        model = load_checkpoint(checkpoint)
        logprobs = SharedPrefixLogprobs(common_prefix([prompt_ids(v) for v in VARIANTS]), settings.temperature)
        rng = random.Random(settings.seed)
        run = run_sao if mode == "sao" else run_grpo
        load_start = os.getloadavg()[0]
        result = await run(session, model, logprobs, settings, rng, start_reward)
        result.load_average = (load_start, os.getloadavg()[0])
        result.pushes, result.push_seconds = session.pushes, session.push_seconds
        result.server_weight_version = await session.server_weight_version()
        result.daemon_policy_version = (await session.client.rollouts.stats()).policy_version
        result.final_eval = await evaluate(session, settings, settings.eval_rollouts)
        return result

    return await with_session(mode, settings, checkpoint, workdir, body)


# ---- output ------------------------------------------------------------------------------------------


def plot(path: Path, results: dict[str, ModeResult], start_eval: dict | None, settings: Settings) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: no plot written, only the JSON logs (pip install matplotlib to get the PNG)"
        )
        return False
    colours = {"sao": "tab:blue", "grpo": "tab:orange"}
    labels = {
        "sao": f"SAO streaming (batch {settings.batch}, {settings.in_flight} in flight)",
        "grpo": f"GRPO group barrier ({settings.groups} x {settings.group_size})",
    }
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for mode, result in results.items():
        xs = [u["t"] for u in result.updates]
        ax.plot(xs, [u["reward"] for u in result.updates], color=colours[mode], alpha=0.18, linewidth=0.8)
        ax.plot(
            xs,
            [u["reward_ma"] for u in result.updates],
            color=colours[mode],
            linewidth=2,
            label=f"{labels[mode]}: moving average of {settings.window} rollouts",
        )
        if result.final_eval and result.final_eval["mean_reward"] is not None:
            ax.scatter([result.wall_s], [result.final_eval["mean_reward"]], color=colours[mode], marker="D", zorder=5)
    if start_eval and start_eval["mean_reward"] is not None:
        ax.scatter(
            [0],
            [start_eval["mean_reward"]],
            color="black",
            marker="D",
            zorder=5,
            label="evaluations (warm start at 0, final policies at the end)",
        )
    ax.axhline(GOAL_REWARD, color="grey", linestyle="--", linewidth=1, label=f"goal {GOAL_REWARD}")
    ax.set_xlabel("wall-clock seconds (training budget)")
    ax.set_ylabel("mean reward of the rollouts trained on")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("sao_toy: online RL of a byte-level GRU through corral (2 CPU cores)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, help="wall-clock training budget per mode (default 15; --smoke 0.25)")
    parser.add_argument("--out", default="runs/", help="folder for the JSON logs and the plot")
    parser.add_argument("--mode", choices=("both", "sao", "grpo"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke", action="store_true", help="a short run (a few updates per mode, tiny warm start): what the test runs"
    )
    parser.add_argument("--lr", type=float, help="Adam learning rate, both modes")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), help="both modes")
    parser.add_argument("--baseline-momentum", type=float, help="SAO: per-task running baseline momentum")
    parser.add_argument("--denominator", choices=("sequence", "token", "kept"), help="loss aggregation, both modes")
    parser.add_argument("--batch", type=int, help="rollouts per update, both modes")
    parser.add_argument("--max-turns", type=int, help="agent turns per rollout (default 2)")
    parser.add_argument("--max-new-tokens", type=int, help="new tokens per turn (default 48)")
    parser.add_argument("--in-flight", type=int, help="SAO: rollouts kept running")
    parser.add_argument("--max-lag", type=int, help="SAO: updates generation may run ahead")
    parser.add_argument("--group-size", type=int, help="GRPO: samples per prompt")
    parser.add_argument("--warm-smoothing", type=float, help="warm start: label smoothing of the cloning loss")
    parser.add_argument("--eval-rollouts", type=int, help="rollouts of each final evaluation")
    parser.add_argument("--max-updates", type=int, help="stop a mode after this many updates")
    parser.add_argument("--warm-from", help="start from this checkpoint instead of running the warm start")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    settings = smoke_settings(args.seed) if args.smoke else Settings(seed=args.seed)
    overrides = {
        "minutes": args.minutes,
        "lr": args.lr,
        "optimizer": args.optimizer,
        "baseline_momentum": args.baseline_momentum,
        "batch": args.batch,
        "denominator": args.denominator,
        "max_turns": args.max_turns,
        "max_new_tokens": args.max_new_tokens,
        "in_flight": args.in_flight,
        "max_lag": args.max_lag,
        "group_size": args.group_size,
        "warm_smoothing": args.warm_smoothing,
        "eval_rollouts": args.eval_rollouts,
        "max_updates": args.max_updates,
    }
    return dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})


async def main_async(settings: Settings, modes: list[str], out: Path, warm_from: str | None = None) -> dict:
    workdir = out / "sao_toy_weights"
    workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # two cores: one for the learner, one for generation, sandboxes and daemon

    if warm_from:
        print(f"warm start: {warm_from}", flush=True)
        model, warm = load_checkpoint(warm_from), WarmStart()
        warm.exact_probability = exact_probabilities(
            model, SharedPrefixLogprobs(common_prefix([prompt_ids(v) for v in VARIANTS]))
        )
    else:
        print(
            f"warm start (behaviour cloning, label smoothing {settings.warm_smoothing}, until the greedy reply "
            "is right for every variant)",
            flush=True,
        )
        model, warm = warm_start(
            settings.seed, smoothing=settings.warm_smoothing, max_steps=settings.warm_max_steps, lr=settings.warm_lr
        )
    checkpoint = save_checkpoint(model, workdir / "warm_start.pt")
    print(
        f"  {warm.steps} steps in {warm.seconds:.1f} s; greedy reply right: {warm.greedy_correct}; exact-reply probability "
        f"{', '.join(f'{k} {v:.2f}' for k, v in warm.exact_probability.items())}",
        flush=True,
    )

    start_eval = await with_session(
        "start", settings, checkpoint, workdir, lambda session: evaluate(session, settings, settings.eval_rollouts)
    )
    print(
        f"  warm start evaluated on {start_eval['rollouts']} rollouts: mean reward {start_eval['mean_reward']}",
        flush=True,
    )

    results: dict[str, ModeResult] = {}
    for mode in modes:
        print(f"{mode}: training for {settings.minutes:g} min", flush=True)
        result = await run_mode(mode, settings, checkpoint, workdir, start_eval["mean_reward"])
        results[mode] = result
        summary = result.summary(settings.window)
        write_json(
            out / f"sao_toy_{mode}.json",
            {
                "summary": summary,
                "settings": dataclasses.asdict(settings),
                "updates": result.updates,
                "rollouts": result.rollouts,
            },
        )
        print(
            f"  {summary['updates']} updates, {summary['rollouts_trained']} rollouts in {summary['wall_s']} s; "
            f"reward first {settings.window}: {summary['reward_first_window']}, last {settings.window}: "
            f"{summary['reward_last_window']}; goal {GOAL_REWARD} reached at "
            f"{summary['seconds_to_goal'] if summary['seconds_to_goal'] is not None else 'never'} s; staleness mean "
            f"{summary['staleness_mean']} max {summary['staleness_max']}; server weight version "
            f"{summary['server_weight_version']}; final evaluation {summary['final_eval']['mean_reward']}",
            flush=True,
        )

    plotted = plot(out / "sao_toy.png", results, start_eval, settings) if results else False
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "settings": dataclasses.asdict(settings),
        "model": {"config": dict(model.config), "parameters": model.num_parameters()},
        "warm_start": {
            "steps": warm.steps,
            "seconds": round(warm.seconds, 1),
            "smoothing": warm.smoothing,
            "greedy_correct": warm.greedy_correct,
            "mean_exact": round(warm.mean_exact, 4),
            "exact_probability": {k: round(v, 4) for k, v in warm.exact_probability.items()},
        },
        "start_eval": start_eval,
        "modes": {mode: result.summary(settings.window) for mode, result in results.items()},
        "plot": str(out / "sao_toy.png") if plotted else None,
    }
    write_json(out / "sao_toy.json", report)
    print(f"wrote {out / 'sao_toy.json'}" + (f" and {out / 'sao_toy.png'}" if plotted else ""), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_from(args)
    modes = ["sao", "grpo"] if args.mode == "both" else [args.mode]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    asyncio.run(main_async(settings, modes, out, args.warm_from))
    return 0


if __name__ == "__main__":
    sys.exit(main())
