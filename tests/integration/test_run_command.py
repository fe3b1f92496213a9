"""`corral run`, as a user runs it: an embedded daemon, the built-in reference server, the bundled
tasks."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from corral.cli.run import is_token_exact, summarize
from corral.sdk.rollout_messages import result_from_proto
from corral.sdk.tasks import load_tasks, task_to_json
from tests.conftest import require_backend
from tests.torch_needed import TORCH_MISSING

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "examples" / "tasks" / "repair.jsonl"


def corral_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "corral.cli", "run", *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_every_bundled_task_reaches_reward_one_with_the_replay_policy(tmp_path) -> None:
    require_backend("local")
    out = tmp_path / "results.jsonl"
    done = corral_run(str(BUNDLED), "--llm", "builtin:replay", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["task_id"] for r in results) == sorted(t.task_id for t in load_tasks(BUNDLED))
    assert all(r["status"] == "completed" and r["reward"] == 1.0 for r in results)
    assert "token-exact trajectories" in done.stdout and f"{len(results)} of {len(results)}" in done.stdout
    # Each evaluated in a clean sandbox: the embedded daemon's local backend cannot snapshot.
    assert {r["eval_sandbox"] for r in results} == {"new"}
    assert f"new sandbox {len(results)}" in done.stdout


def test_the_broken_example_task_is_filtered_as_the_demo_shows(tmp_path) -> None:
    # examples/broken/ is what `make demo` shows an infrastructure failure with.
    require_backend("local")
    out = tmp_path / "broken.jsonl"
    corral_run(str(ROOT / "examples" / "broken" / "broken_task.jsonl"), "--llm", "builtin:replay", "--out", str(out))
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (result["status"], result["filter_reason"]) == ("filtered", "eval_infra"), result["error"]
    assert "cannot be applied" in result["error"] and result["turns"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason=TORCH_MISSING)
def test_the_tiny_policy_samples_real_tokens_with_real_logprobs(tmp_path) -> None:
    require_backend("local")
    [task] = load_tasks(BUNDLED)[:1]
    task.limits.max_turns = 2
    task.limits.max_new_tokens_per_turn = 24
    tasks = tmp_path / "one.jsonl"
    tasks.write_text(task_to_json(task) + "\n")
    out = tmp_path / "results.jsonl"
    done = corral_run(str(tasks), "--llm", "builtin:tiny", "--out", str(out))
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    # An untrained model writes no tool call: the rollout is completed and scored, not filtered.
    assert result["status"] == "completed", result["error"]
    assert result["finish_reason"] in ("unparsable", "max_turns")
    generated = [lp for lp, m in zip(result["response_logprobs"], result["response_mask"]) if m]
    assert generated and all(lp < 0 for lp in generated)
    assert done.returncode == 0  # exit status 1 is for infrastructure failures, not rewards


def test_a_missing_tasks_file_is_a_clear_error(tmp_path) -> None:
    done = corral_run(str(tmp_path / "nope.jsonl"))
    assert done.returncode != 0 and "nope.jsonl" in done.stderr


def test_summary_counts_filtered_reasons_and_token_exactness() -> None:
    from corral.v1 import rollout_pb2 as pb

    good = pb.RolloutResult(
        status=pb.ROLLOUT_STATUS_COMPLETED,
        reward=1.0,
        response_ids=[5, 6, 7],
        response_mask=[1, 0, 0],
        response_logprobs=[-0.1, 0, 0],
        weight_versions=[0, -1, -1],
    )
    good.turns.add(generated_ids=[5], observation_ids=[6, 7])
    good.timings.init_shared_by = 4
    good.timings.fork_ms = 250
    good.timings.eval_sandbox = pb.EVAL_SANDBOX_SNAPSHOT_FORK
    good.timings.eval_sandbox_ms = 500
    broken = pb.RolloutResult(
        status=pb.ROLLOUT_STATUS_FILTERED,
        filter_reason=pb.FILTER_REASON_LLM_UNREACHABLE,
        response_ids=[1],
        response_mask=[1],
        response_logprobs=[0.0],
        weight_versions=[0],
    )
    summary = summarize([result_from_proto(good), result_from_proto(broken)], wall_s=2.0)
    assert (summary.total, summary.completed, summary.solved) == (2, 1, 1)
    assert summary.filtered == {"llm_unreachable": 1}
    assert summary.token_exact == 1 and not is_token_exact(result_from_proto(broken))
    assert summary.rollouts_per_s == 1.0
    assert (summary.init_shared, summary.init_fell_back) == (1, 0) and summary.stage_seconds["fork"] == [0.25, 0.0]
    assert summary.eval_sandboxes == {"snapshot_fork": 1} and summary.stage_seconds["eval_sandbox"] == [0.5, 0.0]
