"""Small tasks for rollout tests, built in code so each test shows what it runs."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterable

from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer
from corral.sdk import AsyncClient
from corral.v1 import rollout_pb2 as pb


def call(name: str, **arguments: object) -> pb.ToolCall:
    return pb.ToolCall(name=name, arguments_json=json.dumps(arguments))


def repair_task(
    task_id: str,
    *,
    eval_command: str = "python3 check.py",
    reward: str = "exit_status",
    solution: Iterable[pb.ToolCall] | None = None,
    **limits: int,
) -> pb.Task:
    """A one-file repair task: `add` subtracts; the reference solution fixes it, checks, submits.
    Each task id gets its own prompt text, so the replay policy tells tasks apart."""
    task = pb.Task(task_id=task_id, limits=pb.TaskLimits(**limits))
    task.setup.files.add(path="calc.py", content=b"def add(a, b):\n    return a - b\n")
    task.prompt.messages.add(role="system", content="You repair Python code.")
    task.prompt.messages.add(role="user", content=f"[{task_id}] add() in {{file}} is wrong; fix it.")
    task.prompt.fields["file"] = "calc.py"
    task.evaluation.files.add(path="check.py", content=b"import calc\nassert calc.add(2, 3) == 5\nprint('ok')\n")
    task.evaluation.commands.append(eval_command)
    getattr(task.evaluation, reward).SetInParent()
    if solution is None:
        solution = [
            call("editor", command="str_replace", path="calc.py", old_str="a - b", new_str="a + b"),
            call("bash", command="python3 -c 'import calc; print(calc.add(2, 2))'"),
            call("submit"),
        ]
    task.reference_solution.extend(solution)
    return task


@contextlib.asynccontextmanager
async def replay_server(tasks: Iterable[pb.Task], *, latency_s: float = 0.0) -> AsyncIterator[ReferenceServer]:
    """The built-in reference server with the replay policy for `tasks`, on a free port; each
    generation takes `latency_s` at least."""
    server = ReferenceServer(ReplayPolicy(list(tasks)), latency_s=latency_s)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def registered_replay_server(client: AsyncClient, tasks: Iterable[pb.Task]) -> AsyncIterator[ReferenceServer]:
    """replay_server for `tasks`, registered with `client`'s daemon while in use, and taken out
    after (the daemons of the conformance cases are shared between tests)."""
    async with replay_server(tasks) as server:
        info = await client.rollouts.register_llm(server.url)
        try:
            yield server
        finally:
            await client.rollouts.remove_llm(info.address)
