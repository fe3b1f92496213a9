"""What evaluating in a clean sandbox costs a rollout, against evaluating in the agent's own
sandbox (docs/rollouts.md, "Evaluation the agent cannot influence"): the SWE-style task of
examples/swe (corral.sdk.swebench's task, the gold patch replayed by the built-in reference
server), one rollout at a time, alternating the two modes (`evaluation.isolation` IN_PLACE and
CLEAN_SANDBOX) so that the machine's load hits both alike, --rollouts of each after one of each
untimed, on each case of --cases:

| case | the clean sandbox |
| --- | --- |
| `local` | the image's root filesystem on the local backend, default storage: no snapshot, a new sandbox set up again (a cold start) |
| `local-btrfs` | the same with `local.storage = "btrfs"`: a fork of the set-up sandbox's snapshot |
| `docker` | the docker image on the btrfs pool (`docker.storage = "btrfs"`): a fork of the snapshot |

Per case and mode: the INIT stage (clean: with the manifest of /testbed and the snapshot), the
EVAL stage, and within a clean EVAL reading the agent's change (`eval_change`) and getting the
clean sandbox (`eval_sandbox`: the agent's destroyed, then the fork or the new sandbox); then the
time clean evaluation adds per rollout, p50(clean) - p50(in place) of INIT, of EVAL and of both.

Usage: python bench/clean_eval.py [--quick] [--json PATH] [--cases local,local-btrfs,docker] [--rollouts 10]
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from _common import SWE_IMAGES, Daemon, backend_missing, parse_args, print_header, print_table, summary, write_json

from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer
from corral.sdk import AsyncClient
from corral.sdk.swebench import instance_to_task
from corral.v1 import rollout_pb2 as pb

INSTANCE = json.loads((Path(__file__).resolve().parents[1] / "examples" / "swe" / "instances.jsonl").read_text())
ACTIVATE = ". /opt/venv/bin/activate"
CASES = {
    "local": ("local", ""),
    "local-btrfs": ("local", '[local]\nstorage = "btrfs"\n'),
    "docker": ("docker", '[docker]\nstorage = "btrfs"\nstorage_bytes = 8589934592\n'),
}
MODES = {"in place": pb.EVALUATION_ISOLATION_IN_PLACE, "clean": pb.EVALUATION_ISOLATION_CLEAN_SANDBOX}


def extra_args(parser) -> None:
    parser.add_argument("--cases", default=",".join(CASES), help="of " + ", ".join(CASES))
    parser.add_argument("--rollouts", type=int, default=10, help="timed rollouts of each mode per case")


def task_for(backend: str, mode: str, index: int) -> pb.Task:
    task = instance_to_task(INSTANCE, backend=backend, image_map=SWE_IMAGES[backend], activate=ACTIVATE)
    task.task_id = f"{backend} {mode} {index}"
    task.prompt.messages[-1].content = f"[{task.task_id}] " + task.prompt.messages[-1].content
    task.evaluation.isolation = MODES[mode]
    return task


async def measure(case: str, rollouts: int) -> tuple[dict[str, dict], dict[str, dict[str, list[float]]]]:
    backend, config = CASES[case]
    plan = [(mode, index) for index in range(rollouts + 1) for mode in (MODES if index % 2 else reversed(MODES))]
    tasks = {(mode, index): task_for(backend, mode, index) for mode, index in plan}
    samples: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    sources: dict[str, set[str]] = {mode: set() for mode in MODES}
    server = ReferenceServer(ReplayPolicy(list(tasks.values())))
    await server.start()
    try:
        with Daemon(config="[daemon]\nmax_sandboxes = 50\n" + config) as daemon:
            async with AsyncClient(daemon.address) as client:
                await client.rollouts.register_llm(server.url)
                for mode, index in plan:
                    [result] = [r async for r in client.rollouts.stream([tasks[mode, index]])]
                    if result.status != "completed" or result.reward != 1.0:
                        raise RuntimeError(f"{case} {mode}: {result.status} {result.reward} {result.error}")
                    sources[mode].add(result.eval_sandbox)
                    if index == 0:
                        continue  # untimed: the first of each mode
                    times = result.timings
                    for name in ("init", "eval", "eval_change", "eval_sandbox"):
                        if mode == "clean" or not name.startswith("eval_"):
                            samples[mode].setdefault(name, []).append(times[name] * 1000)
                    samples[mode].setdefault("init + eval", []).append((times["init"] + times["eval"]) * 1000)
    finally:
        await server.stop()
    results = {f"{case} {mode}: {name}": summary(values) for mode in MODES for name, values in samples[mode].items()}
    for mode in MODES:
        print(f"  {case} {mode}: evaluated in {', '.join(sorted(sources[mode]))}")
    return results, samples


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], extra_args)
    rollouts = 3 if args.quick else args.rollouts
    print_header("clean evaluation: the SWE-style task, in place against a clean sandbox, one rollout at a time")
    results: dict[str, dict] = {}
    added: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for case in args.cases.split(","):
        backend = CASES[case][0]
        missing = backend_missing(backend)
        if missing is None and not (os.path.isdir(SWE_IMAGES[backend]) or backend != "local"):
            missing = f"{SWE_IMAGES[backend]} missing: run scripts/build_swe_test_image.sh"
        if missing is not None:
            skipped[case] = missing
            continue
        case_results, _ = asyncio.run(measure(case, rollouts))
        results.update(case_results)
        for name in ("init", "eval", "init + eval"):
            clean, in_place = case_results[f"{case} clean: {name}"], case_results[f"{case} in place: {name}"]
            added[f"{case}: {name}"] = round(clean["p50_ms"] - in_place["p50_ms"], 1)
    print_table("per rollout (ms)", results, skipped)
    print("\n  added by clean evaluation, p50(clean) - p50(in place), ms:")
    for name, value in added.items():
        print(f"    {name:<24} {value:>9.1f}")
    print_header("end")
    write_json(args.json, results, {}, {"added_p50_ms": added, "skipped": skipped, "load_end": os.getloadavg()})


if __name__ == "__main__":
    main()
