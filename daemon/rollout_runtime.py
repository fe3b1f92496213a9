"""The daemon's rollout machinery, built from the `[rollout]` configuration: the LLM server pool,
the tokenizer, the LLM gateway of harness tasks and the INIT / RUN / EVAL pipeline, with their
start and shutdown order; and the submission of rollouts, which a draining node refuses."""

from __future__ import annotations

from pathlib import Path

from corral.daemon.callers import current_caller
from corral.daemon.config import RolloutConfig
from corral.daemon.gateway_access import GatewayAccess
from corral.daemon.llm_pool import LLMPool
from corral.daemon.metrics import Metrics
from corral.daemon.sandboxes import SandboxManager
from corral.rollout.evaluation import ROLLOUT_LABEL
from corral.rollout.gateway import Gateway
from corral.rollout.harness import HarnessHost
from corral.rollout.pipeline import PipelineSettings, ResultSink, Rollout, RolloutPipeline, StageSettings, TurnSink
from corral.rollout.tokenizer import load_tokenizer
from corral.sdk import AsyncClient
from corral.sdk.errors import Unavailable
from corral.v1 import rollout_pb2 as pb


def pipeline_settings(config: RolloutConfig, max_sandboxes: int) -> PipelineSettings:
    """The pipeline of a daemon whose node admits `max_sandboxes` (daemon.max_sandboxes): its
    rollouts wait for room among their own sandboxes rather than be refused for them."""
    return PipelineSettings(
        init=StageSettings(config.init_workers, config.init_timeout_s, config.queue_size),
        run=StageSettings(config.run_workers, config.run_timeout_s, config.queue_size),
        eval=StageSettings(config.eval_workers, config.eval_timeout_s, config.queue_size),
        init_retries=config.init_retries,
        allow_host_harness=config.allow_host_harness,
        init_once=config.init_once,
        max_sandboxes=max_sandboxes,
    )


class RolloutRuntime:
    """Owns the pool, the gateway, the pipeline and the pipeline's client of this daemon's own
    socket (the pipeline uses the same SDK calls as any trainer)."""

    def __init__(self, config: RolloutConfig, socket_path: Path, sandboxes: SandboxManager, metrics: Metrics) -> None:
        self.llms = LLMPool(
            timeout_s=config.llm_timeout_s,
            max_attempts=config.llm_attempts,
            unavailable_wait_s=config.llm_unavailable_wait_s,
        )
        self.sandboxes = sandboxes
        self.address = f"unix://{socket_path}"
        self.client = AsyncClient(self.address)
        self.metrics = metrics
        tokenizer = load_tokenizer(config.tokenizer)
        self.pipeline = RolloutPipeline(
            self.client,
            self.llms.generate,
            tokenizer,
            settings=pipeline_settings(config, sandboxes.config.daemon.max_sandboxes),
            has_llm=lambda: len(self.llms) > 0,
            forget_rollout=self.llms.forget,
            context_length=self.llms.context_length,
        )
        self.gateway = Gateway(
            self.llms.generate,
            tokenizer,
            policy_version=lambda: self.pipeline.policy_version,
            context_length=self.llms.context_length,
        )
        self.gateway_access = GatewayAccess(self.gateway, sandboxes, config.gateway_listen)
        # The sandboxes of this daemon's own live rollouts (the pipeline labels each with its
        # rollout): a draining node still makes them, so that rollouts accepted before finish,
        # and [admission]'s pace caps leave them to rollout.init_workers.
        sandboxes.own_rollout = lambda labels: self.pipeline.is_live(labels.get(ROLLOUT_LABEL, ""))
        # They are their submitter's (callers.py), though the daemon makes them.
        sandboxes.rollout_owner = lambda labels: self.pipeline.submitter_of(labels.get(ROLLOUT_LABEL, ""))

    async def start(self) -> None:
        host_url = await self.gateway_access.start()
        self.pipeline.enable_harnesses(
            self.gateway,
            HarnessHost(
                host_url=host_url,
                daemon_address=self.address,
                sandbox_gateway=self.gateway_access.in_sandbox,
                model_name=self.gateway.model_name,
            ),
            on_session_closed=self.metrics.count_gateway_session,
        )
        self.pipeline.start()

    async def submit(
        self, task: pb.Task, options: pb.RolloutOptions, deliver: ResultSink, on_turn: TurnSink | None = None
    ) -> list[Rollout]:
        """pipeline.submit as the current caller's rollouts, refused (UNAVAILABLE) while the node
        drains."""
        if self.sandboxes.draining:
            raise Unavailable("this node is draining: it takes no new rollouts (submit them to another node)")
        return await self.pipeline.submit(task, options, deliver, on_turn, submitter=current_caller().owner)

    async def close(self) -> None:
        """Ends unfinished rollouts (FILTERED, reason SHUTDOWN) and destroys their sandboxes; call
        while the daemon still serves, since the pipeline reaches sandboxes through its socket."""
        await self.pipeline.close()
        await self.gateway_access.close()
        await self.llms.close()
        await self.client.close()
