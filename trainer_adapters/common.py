"""What every trainer adapter shares: the two ways to plug corral into a trainer.

- **Tools mode** (`ToolsModeRollouts`): the trainer keeps generation (its own inference engine,
  token-in/token-out) and corral runs everything else. It is the daemon's own rollout pipeline
  (INIT / RUN / EVAL, the agent loop, evaluation, filtering, cleanup) run inside the trainer's
  process with the trainer's generate function; sandboxes, shells and kernels come from the node
  daemon over its socket.
- **Service mode** (`connect_service`): the daemon runs whole rollouts against the trainer's
  inference servers (registered with its RolloutService) and streams results back; adapters
  convert each `RolloutResult` into the trainer's type as it arrives.

Both give `corral.sdk.RolloutResult`s, so each adapter only converts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

from corral.rollout.pipeline import PipelineSettings, RolloutPipeline, StageSettings
from corral.rollout.tokenizer import chat_tokenizer
from corral.rollout.types import GenerateFn
from corral.sdk import AlreadyExists, AsyncClient, CorralError, RolloutResult, Unavailable
from corral.sdk.rollout_messages import build_options, result_from_proto
from corral.sdk.tasks import TaskLike, task_from
from corral.v1 import rollout_pb2 as pb

# In a trainer process the trainer decides how many rollouts run at once; the pools only bound
# sandbox starts and evaluations so that a burst does not overload the node.
TOOLS_MODE_SETTINGS = PipelineSettings(
    init=StageSettings(workers=16, timeout_s=300.0),
    run=StageSettings(workers=1024, timeout_s=1800.0),
    eval=StageSettings(workers=16, timeout_s=600.0),
)


class DaemonNotRunning(Unavailable):
    """The corral daemon cannot be reached at the address the adapter tried."""


async def connect(address: str | None = None) -> AsyncClient:
    """A client of the node daemon, checked to answer: DaemonNotRunning names the address tried."""
    client = AsyncClient(address)
    try:
        await client.node_info()
    except CorralError as error:
        await client.close()
        raise DaemonNotRunning(
            f"no corral daemon answers at {client.address}: {error}. Start one with "
            "`corral serve` (or the systemd unit), or pass its address"
        ) from None
    return client


class ToolsModeRollouts:
    """Runs rollouts in this process with the trainer's generate function.

    `generate(prompt_ids, sampling, rollout_id) -> Generation` (see corral.rollout.types);
    `tokenizer`: the trainer's Hugging Face tokenizer object, a local tokenizer directory, or
    "byte". `address`: the node daemon (default: $CORRAL_ADDRESS / $CORRAL_SOCKET / the system
    socket). One instance serves one event loop; `close()` ends unfinished rollouts and frees
    their sandboxes.
    """

    def __init__(
        self,
        generate: GenerateFn,
        tokenizer: Any,
        *,
        address: str | None = None,
        settings: PipelineSettings = TOOLS_MODE_SETTINGS,
    ) -> None:
        self._generate = generate
        self._tokenizer = chat_tokenizer(tokenizer)
        self._address = address
        self._settings = settings
        self._pipeline: RolloutPipeline | None = None
        self._client: AsyncClient | None = None
        self._starting = asyncio.Lock()
        self._policy_version = 0

    async def start(self) -> None:
        """Connects to the daemon (DaemonNotRunning if it does not answer) and starts the stages.
        `run` calls it on first use."""
        async with self._starting:
            if self._pipeline is not None:
                return
            self._client = await connect(self._address)
            self._pipeline = RolloutPipeline(self._client, self._generate, self._tokenizer, settings=self._settings)
            self._pipeline.set_policy_version(self._policy_version)
            self._pipeline.start()

    def set_policy_version(self, version: int) -> None:
        """The trainer's current policy version: generations that report none are stamped with it,
        and `max_staleness` is measured against it."""
        self._policy_version = version
        if self._pipeline is not None:
            self._pipeline.set_policy_version(version)

    async def run(
        self, task: TaskLike, *, max_staleness: int | None = None, group_id: str | None = None
    ) -> RolloutResult:
        """One rollout of `task`, start to end. Cancelling it cancels the rollout and waits until
        its sandbox is gone."""
        await self.start()
        assert self._pipeline is not None
        done: asyncio.Future[pb.RolloutResult] = asyncio.get_running_loop().create_future()

        def deliver(result: pb.RolloutResult) -> None:
            if not done.done():
                done.set_result(result)

        rollouts = await self._pipeline.submit(
            task_from(task), build_options(max_staleness=max_staleness, group_id=group_id), deliver
        )
        try:
            return result_from_proto(await asyncio.shield(done))
        except asyncio.CancelledError:
            for rollout in rollouts:
                self._pipeline.cancel(rollout.rollout_id)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(done), 60)  # delivered once the sandbox is destroyed
            raise

    async def close(self) -> None:
        if self._pipeline is not None:
            await self._pipeline.close()
            self._pipeline = None
        if self._client is not None:
            await self._client.close()
            self._client = None


async def connect_service(
    servers: Iterable[str], *, protocol: str = "sglang", address: str | None = None, policy_version: int | None = None
) -> AsyncClient:
    """Service mode: a client of the node daemon with the trainer's inference servers registered
    (servers registered already are kept). Then `client.rollouts.stream(tasks)` yields results as
    they finish."""
    client = await connect(address)
    for server in servers:
        with contextlib.suppress(AlreadyExists):
            await client.rollouts.register_llm(server, protocol=protocol)
    if policy_version is not None:
        await client.rollouts.set_policy_version(policy_version)
    return client


def weight_version_span(result: RolloutResult) -> tuple[int, int] | None:
    """The oldest and newest weight versions that generated tokens of a result (None if none)."""
    versions = [turn.weight_version for turn in result.turns if turn.generated_ids]
    return (min(versions), max(versions)) if versions else None
