"""Codex CLI solves every bundled repair task as a harness task: the real `codex exec` (npm's
@openai/codex, its native binary) runs inside each rollout's local sandbox (bubblewrap, network
off: the gateway on the sandbox's loopback is all it reaches), talks OpenAI's Responses API to the
daemon's LLM gateway, and edits the task's files with its own tools, while the built-in reference
server plays each task's reference solution in Codex's vocabulary (exec_command, apply_patch as
a custom tool, a final reply without tool calls; rollout/reference/vocabularies/codex.py).

Checked per task: reward 1.0; one Codex call per reference call (the submit call is the final
reply); the sample is token-exact against what the engine itself received and generated (the
last prompt plus its output, every earlier call at its place, mask 1 exactly on generated ids);
the gateway's counters: every call after the first a prefix hit (Codex sends the whole history
back as the gateway returned it, with its call ids), no splice, no split, nothing discarded.

The CLIs' npm prefix (CORRAL_CODING_CLIS, /opt/corral-clis) is shown read-only in every sandbox
(`local.host_paths`); node, which runs npm's `codex` launcher, is the host image's. About 60 s
for the 25 tasks on a 2-core machine (`make test` runs a fifth of them: coding_cli_support.py).

With the sandbox's network off (the default), Codex reaches only the gateway: with its plugin
sync turned back on, which at start runs `git ls-remote https://github.com/openai/plugins.git`
and queries api.github.com (seen with strace on the host), a task still completes token-exact,
while a probe in the same sandbox finds the outside unreachable and the gateway reachable.
"""

from __future__ import annotations

from tests.conftest import require_coding_cli

require_coding_cli("codex")

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from corral.rollout.reference.replay import ReplayPolicy  # noqa: E402
from corral.rollout.reference.server import load_tasks_jsonl  # noqa: E402
from corral.rollout.reference.vocabularies import FINAL_TEXT, vocabulary  # noqa: E402
from corral.sdk import AsyncClient, RolloutResult  # noqa: E402
from corral.v1 import rollout_pb2 as pb  # noqa: E402
from tests.conftest import DaemonProcess  # noqa: E402
from tests.integration.coding_cli_support import (  # noqa: E402
    REPAIR_TASKS,
    check_token_exact,
    cli_daemon,
    cli_tasks,
)
from tests.integration.replay_rollouts import (  # noqa: E402
    Exchanges,
    RecordingReplay,
    run_all,
)

pytestmark = [pytest.mark.above_backend, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    yield from cli_daemon(tmp_path_factory.mktemp("daemon-codex"))


def codex_tasks(tasks: list[pb.Task] | None = None) -> list[pb.Task]:
    return cli_tasks("codex", tasks, max_new_tokens_per_turn=4096)


def check_codex_solved(result: RolloutResult, task: pb.Task, exchanges: Exchanges, replay: ReplayPolicy) -> None:
    check_token_exact(result, task, exchanges)
    names = [[call.name for call in turn.tool_calls] for turn in result.turns]
    assert all(len(calls) == 1 and calls[0] in ("exec_command", "apply_patch") for calls in names[:-1]), names
    assert replay.tokenizer.decode(exchanges[-1][1]).startswith(FINAL_TEXT)
    assert ["apply_patch"] in names, names  # every bundled edit is whole lines: a patch


# Run before Codex in the harness's sandbox: which addresses a connection reaches (into the
# workdir, which the evaluation sees).
PROBE = """python3 -c '
import os, socket, urllib.parse
def reach(host, port):
    try:
        socket.create_connection((host, port), 3).close()
        return "connected"
    except OSError as error:
        return "failed: %s" % error
gateway = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
with open(os.path.join(os.environ["CORRAL_WORKDIR"], "net-probe.txt"), "w") as out:
    out.write("outside-ip %s\\n" % reach("1.1.1.1", 443))
    out.write("outside-name %s\\n" % reach("github.com", 443))
    out.write("gateway %s\\n" % reach(gateway.hostname, gateway.port))
'"""


async def test_codex_reaches_only_the_gateway_with_the_network_off(daemon) -> None:
    (task,) = codex_tasks([t for t in load_tasks_jsonl(REPAIR_TASKS) if t.task_id == "accounts-super-init"])
    script = task.harness.command[2].replace(" exec ", " exec --enable plugins --enable remote_plugin ", 1)
    task.harness.command[2] = f"{PROBE}; {script}"
    # Evaluated in a fresh sandbox with the workdir's changes: the probe's file is one of them.
    task.evaluation.commands.insert(0, "cat net-probe.txt")
    replay = ReplayPolicy([task], vocabulary=vocabulary("codex"))
    policy = RecordingReplay(replay)
    async with AsyncClient(daemon.address) as client:
        (result,) = await run_all(client, [task], policy)
    check_codex_solved(result, task, policy.exchanges[task.task_id], replay)
    probe = result.eval_output.decode()
    assert "outside-ip failed:" in probe and "outside-name failed:" in probe, probe
    assert "gateway connected" in probe, probe


async def test_codex_solves_the_bundled_tasks_token_exact(daemon) -> None:
    tasks = codex_tasks()
    replay = ReplayPolicy(tasks, vocabulary=vocabulary("codex"))
    policy = RecordingReplay(replay)
    async with AsyncClient(daemon.address) as client:
        results = await run_all(client, tasks, policy)
    by_id = {task.task_id: task for task in tasks}
    assert sorted(r.task_id for r in results) == sorted(by_id)
    for result in results:
        check_codex_solved(result, by_id[result.task_id], policy.exchanges[result.task_id], replay)
