"""The Miles adapter (corral.trainer_adapters.miles) end to end, against a real daemon and the
built-in reference server (replay policy) standing in for Miles' SGLang router: its /generate is
SGLang's protocol, which is all the router is to the adapter.

Miles cannot be installed here (GitHub only, GPU stack), so these tests inject a stand-in `miles`
package into sys.modules: `miles.utils.types.Sample` with exactly the fields and Status values of
Miles' Sample at commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76 (miles/utils/types.py) and the
length checks of its validate(), and `miles.rollout.base_types.GenerateFnInput` /
`GenerateFnOutput` as at that commit. Miles' `args` is a namespace with the attributes the adapter
reads, its GenerateState one with `args`, `tokenizer` and `aborted`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import inspect
import json
import subprocess
import sys
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web
from google.protobuf import json_format

from corral.cli.run import is_token_exact
from corral.rollout.llm.routing import ROUTING_KEY_HEADER
from corral.rollout.prompt import fill_prompt_fields
from corral.rollout.tokenizer import ByteChatTokenizer
from corral.sdk import AsyncClient, AsyncRollouts, InvalidArgument, RolloutResult, load_tasks
from corral.trainer_adapters import miles as adapter
from corral.trainer_adapters.common import ToolsModeRollouts
from tests.rollout_tasks import repair_task, replay_server

ROOT = Path(__file__).resolve().parents[2]
MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"


# -- the stand-in `miles` package -----------------------------------------------------------------


@dataclass(frozen=True)
class AdapterRef:
    name: str
    slot: int


@dataclass(frozen=True)
class RewardSpec:
    rm_type: str | None = None
    custom_rm_path: str | None = None


@dataclass
class Sample:
    """Stand-in for miles.utils.types.Sample at commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76:
    the same fields, in the same order, with the same defaults, the same Status values, and
    validate() making the same length checks (multimodal expansion of routed experts left out).
    Written for these tests; no Miles code."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    # Miles annotates these two `dict[str, Any]` with a None default.
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    rollout_indexer_topk: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    opd_reverse_kl: list[float] | None = None

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict | None = None
    adapter: AdapterRef | None = None
    reward_spec: RewardSpec | None = None
    routing_key: str | None = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def validate(self) -> None:
        assert self.response_length >= 0, self.response_length
        assert len(self.tokens) >= self.response_length, (len(self.tokens), self.response_length)
        for name in ("loss_mask", "rollout_log_probs", "teacher_log_probs", "opd_reverse_kl"):
            values = getattr(self, name)
            if values is not None:
                assert len(values) == self.response_length, (name, len(values), self.response_length)
        for name in ("rollout_routed_experts", "rollout_indexer_topk"):
            values = getattr(self, name)
            if values is not None:
                assert len(values) == len(self.tokens) - 1, (name, len(values), len(self.tokens))


# The field names of Miles' Sample at MILES_COMMIT, in order.
MILES_SAMPLE_FIELDS = [
    "group_index",
    "index",
    "rollout_id",
    "prompt",
    "tokens",
    "multimodal_inputs",
    "multimodal_train_inputs",
    "response",
    "response_length",
    "label",
    "reward",
    "loss_mask",
    "weight_versions",
    "rollout_log_probs",
    "rollout_routed_experts",
    "rollout_indexer_topk",
    "remove_sample",
    "teacher_log_probs",
    "opd_reverse_kl",
    "status",
    "metadata",
    "generate_function_path",
    "train_metadata",
    "adapter",
    "reward_spec",
    "routing_key",
    "non_generation_time",
    "spec_info",
    "prefix_cache_info",
]


@dataclass(frozen=True)
class GenerateFnInput:
    """Stand-in for miles.rollout.base_types.GenerateFnInput at MILES_COMMIT."""

    state: Any
    sample: Sample
    sampling_params: dict[str, Any]
    evaluation: bool

    @property
    def args(self) -> Any:
        return self.state.args


@dataclass(frozen=True)
class GenerateFnOutput:
    """Stand-in for miles.rollout.base_types.GenerateFnOutput at MILES_COMMIT."""

    samples: Sample | list[Sample]


@pytest.fixture(autouse=True, scope="module")
def stand_in_miles():
    """Puts the stand-in `miles` package into sys.modules for this module's tests."""
    modules = {
        name: types.ModuleType(name)
        for name in ("miles", "miles.utils", "miles.utils.types", "miles.rollout", "miles.rollout.base_types")
    }
    modules["miles.utils.types"].Sample = Sample
    modules["miles.utils.types"].AdapterRef = AdapterRef
    modules["miles.utils.types"].RewardSpec = RewardSpec
    modules["miles.rollout.base_types"].GenerateFnInput = GenerateFnInput
    modules["miles.rollout.base_types"].GenerateFnOutput = GenerateFnOutput
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    yield
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


# -- helpers --------------------------------------------------------------------------------------

SAMPLING = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_new_tokens": 1024,
    "stop": None,
    "stop_token_ids": None,
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "spaces_between_special_tokens": False,
}


def miles_args(router: str, daemon_address: str, **overrides: Any) -> argparse.Namespace:
    host, port = router.removeprefix("http://").rsplit(":", 1)
    values = dict(
        sglang_router_ip=host,
        sglang_router_port=int(port),
        sglang_router_policy=None,
        sglang_router_request_timeout_secs=60,
        rollout_max_context_len=None,
        hf_checkpoint=None,
        corral_address=daemon_address,
        corral_tokenizer=None,
        corral_max_staleness=None,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def miles_state(args: argparse.Namespace) -> types.SimpleNamespace:
    """Miles' GenerateState as the adapter sees it: Miles' tokenizer is the byte-level one here."""
    return types.SimpleNamespace(args=args, tokenizer=ByteChatTokenizer(), aborted=False)


def task_json(task) -> dict:
    return json_format.MessageToDict(task)


def sample_for(task, index: int = 0, prompt: Any = "") -> Sample:
    """A sample as Miles' Dataset builds it from the prompt data."""
    return Sample(index=index, group_index=index, prompt=prompt, metadata={adapter.CORRAL_TASK_KEY: task_json(task)})


async def labelled_sandboxes(address: str, task_id: str) -> list:
    async with AsyncClient(address) as client:
        return [s for s in await client.list_sandboxes() if s.labels.get("io.corral.task") == task_id]


class Router:
    """Miles' SGLang router stand-in: forwards /generate to the reference server and records the
    routing-key header of each request."""

    def __init__(self, upstream: str, *, abort: bool = False) -> None:
        self.upstream = upstream
        self.abort = abort  # answer every generation as an engine abort would
        self.routing_keys: list[str | None] = []
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None
        self.url = ""

    async def _generate(self, request: web.Request) -> web.Response:
        self.routing_keys.append(request.headers.get(ROUTING_KEY_HEADER))
        assert self._session is not None  # serving: __aenter__ made it
        async with self._session.post(
            self.upstream + "/generate", data=await request.read(), headers={"Content-Type": "application/json"}
        ) as answer:
            body = await answer.read()
            if self.abort:
                data = json.loads(body)
                data["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort before prefill"}
                body = json.dumps(data).encode()
            return web.Response(body=body, status=answer.status, content_type="application/json")

    async def __aenter__(self) -> Router:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        self._session = ClientSession()
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._runner is not None and self._session is not None  # __aenter__ made them
        await self._runner.cleanup()
        await self._session.close()


@pytest.fixture
def corral_results(monkeypatch) -> dict[str, RolloutResult]:
    """Every RolloutResult the adapter gets (tools mode: from ToolsModeRollouts.run; service mode:
    from the SDK's rollouts.run), by rollout id: what each filled sample is checked against."""
    results: dict[str, RolloutResult] = {}

    class RecordingToolsModeRollouts(ToolsModeRollouts):
        async def run(self, task, **options):
            result = await super().run(task, **options)
            results[result.rollout_id] = result
            return result

    service_run = AsyncRollouts.run

    async def recording_service_run(self, task, **options):
        result = await service_run(self, task, **options)
        results[result.rollout_id] = result
        return result

    monkeypatch.setattr(adapter, "ToolsModeRollouts", RecordingToolsModeRollouts)
    monkeypatch.setattr(AsyncRollouts, "run", recording_service_run)
    return results


def assert_filled_like(sample: Sample, result: RolloutResult) -> None:
    sample.validate()
    assert sample.loss_mask is not None and sample.rollout_log_probs is not None
    assert len(sample.loss_mask) == sample.response_length == len(sample.rollout_log_probs)
    assert sample.tokens == result.prompt_ids + result.response_ids
    assert sample.tokens[-sample.response_length :] == result.response_ids
    assert sample.loss_mask == result.response_mask
    assert sample.rollout_log_probs == result.response_logprobs
    assert sample.weight_versions == [str(turn.weight_version) for turn in result.turns]
    assert sample.response == ByteChatTokenizer().decode(result.response_ids)


# -- without a daemon -----------------------------------------------------------------------------


def test_the_module_imports_without_miles() -> None:
    code = (
        "import sys, corral.trainer_adapters.miles\n"
        "assert not [m for m in sys.modules if m == 'miles' or m.startswith('miles.')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_the_stand_in_mirrors_miles_sample() -> None:
    assert [f.name for f in dataclasses.fields(Sample)] == MILES_SAMPLE_FIELDS
    assert {s.name: s.value for s in Sample.Status} == {
        "PENDING": "pending",
        "COMPLETED": "completed",
        "TRUNCATED": "truncated",
        "ABORTED": "aborted",
        "FAILED": "failed",
    }
    Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 0], rollout_log_probs=[0.0, 0.0]).validate()
    bad_fields: list[dict[str, Any]] = [
        dict(loss_mask=[1]),
        dict(rollout_log_probs=[0.0, 0.0, 0.0]),
        dict(response_length=4),
    ]
    for bad in bad_fields:
        with pytest.raises(AssertionError):
            Sample(**{"tokens": [1, 2, 3], "response_length": 2, **bad}).validate()


def test_the_entry_points_are_what_miles_loads() -> None:
    """Miles takes a function as legacy when it has >= 3 parameters and the first is not named
    `input` (miles/rollout/inference_rollout/compatibility.py), and calls `fn.add_arguments(parser)`."""

    def legacy(fn) -> bool:
        params = list(inspect.signature(fn).parameters)
        return len(params) >= 3 and params[0] != "input"

    assert list(inspect.signature(adapter.generate).parameters) == ["input"] and not legacy(adapter.generate)
    assert list(inspect.signature(adapter.service_generate).parameters) == ["input"]
    assert legacy(adapter.generate_legacy)
    for fn in (adapter.generate, adapter.generate_legacy, adapter.service_generate):
        assert inspect.iscoroutinefunction(fn)
        parser = argparse.ArgumentParser()
        add_arguments = fn.add_arguments  # type: ignore[union-attr]  # set on the entry points by the adapter
        add_arguments(parser)
        add_arguments(parser)  # twice is harmless
        args = parser.parse_args(
            ["--corral-address", "unix:///x.sock", "--corral-tokenizer", "byte", "--corral-max-staleness", "2"]
        )
        assert (args.corral_address, args.corral_tokenizer, args.corral_max_staleness) == ("unix:///x.sock", "byte", 2)
    assert parser.parse_args([]).corral_max_staleness is None


def test_the_task_comes_from_metadata_completed_from_the_sample_and_miles_sampling() -> None:
    task = repair_task("meta")
    task.sampling.temperature = 0.2
    task.sampling.stop.append("STOP")
    args = argparse.Namespace(rollout_max_context_len=4096)
    miles_sampling = {**SAMPLING, "temperature": 0.7, "top_k": 20, "stop": ["END"]}
    built = adapter.task_for_sample(sample_for(task), miles_sampling, args)
    assert built.task_id == "meta" and built.prompt == task.prompt and built.evaluation == task.evaluation
    assert built.sampling.temperature == pytest.approx(0.7) and built.sampling.top_k == 20
    assert list(built.sampling.stop) == ["STOP", "END"]
    assert (built.limits.max_new_tokens_per_turn, built.limits.max_total_tokens) == (1024, 4096)
    task.limits.max_new_tokens_per_turn = 64
    assert adapter.task_for_sample(sample_for(task), SAMPLING, args).limits.max_new_tokens_per_turn == 64

    # JSON text works too; no prompt messages: the sample's prompt, verbatim, braces and all.
    bare = repair_task("")
    del bare.prompt.messages[:]
    sample = Sample(index=7, prompt="fix {file} in {{x}}", metadata={"corral_task": json.dumps(task_json(bare))})
    built = adapter.task_for_sample(sample, SAMPLING)
    assert built.task_id == "miles-7"
    assert [(m.role, m.content) for m in built.prompt.messages] == [("user", "fix {{file}} in {{{{x}}}}")]
    sample.prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert [m.role for m in adapter.task_for_sample(sample, SAMPLING).prompt.messages] == ["system", "user"]
    assert sample.metadata == {"corral_task": json.dumps(task_json(bare))}  # the sample's metadata is untouched

    with pytest.raises(InvalidArgument, match="corral_task"):
        adapter.task_for_sample(Sample(prompt="hi"), SAMPLING)
    with pytest.raises(InvalidArgument, match="prompt"):
        adapter.task_for_sample(Sample(metadata={"corral_task": task_json(bare)}), SAMPLING)


def _result(**changes: Any) -> RolloutResult:
    values: dict[str, Any] = dict(
        rollout_id="t/0/ab",
        task_id="t",
        group_id="g",
        sample_index=0,
        status="completed",
        filter_reason=None,
        error="",
        reward=0.5,
        finish_reason="submitted",
        prompt_ids=[1, 2],
        response_ids=[65, 66, 10],
        response_mask=[1, 1, 0],
        response_logprobs=[-0.5, -0.25, 0.0],
        weight_versions=[3, 3, -1],
        turns=[],
        messages=[],
        timings={},
        format_errors=0,
        eval_output=b"",
        metadata={},
    )
    values.update(changes)
    return RolloutResult(**values)


@pytest.mark.parametrize(
    "status, finish, filter_reason, miles_status, reward",
    [
        ("completed", "submitted", None, "completed", 0.5),
        ("completed", "unparsable", None, "completed", 0.5),
        ("completed", "max_turns", None, "truncated", 0.5),
        ("completed", "context_full", None, "truncated", 0.5),
        ("completed", "timeout", None, "truncated", 0.5),
        ("filtered", None, "backend_crash", "aborted", None),
        ("cancelled", None, None, "aborted", None),
    ],
)
def test_statuses_and_rewards(status, finish, filter_reason, miles_status, reward) -> None:
    sample = adapter.fill_sample(
        Sample(metadata={"corral_task": {}}),
        _result(status=status, finish_reason=finish, filter_reason=filter_reason),
        ByteChatTokenizer(),
    )
    sample.validate()
    assert (sample.status.value, sample.reward) == (miles_status, reward)
    assert sample.tokens == [1, 2, 65, 66, 10] and sample.response == "AB\n"
    assert sample.metadata["corral_filter_reason"] == filter_reason and "corral_task" in sample.metadata


# -- end to end -----------------------------------------------------------------------------------


def test_tasks_jsonl_converts_to_miles_prompt_data(tmp_path) -> None:
    out = tmp_path / "prompt.jsonl"
    assert adapter.main([str(ROOT / "examples" / "tasks" / "repair.jsonl"), "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    tasks = load_tasks(ROOT / "examples" / "tasks" / "repair.jsonl")
    assert len(rows) == len(tasks)
    for row, task in zip(rows, tasks):
        user = [m for m in task.prompt.messages if m.role == "user"][0]
        assert set(row) == {"input", "metadata"}
        assert row["input"] == fill_prompt_fields(user.content, task.prompt.fields)
        assert adapter.task_for_sample(Sample(metadata=row["metadata"])) == task


def dataset_sample(task, index: int) -> Sample:
    """A sample as Miles' Dataset builds it from a prompt-data row (--input-key input,
    --metadata-key metadata), the row made by the converter."""
    row = json.loads(json.dumps(adapter.prompt_data_row(task)))
    return Sample(index=index, group_index=index, prompt=row["input"], metadata=row["metadata"])


async def test_tools_mode_fills_miles_samples_for_bundled_tasks(local_daemon, corral_results) -> None:
    tasks = load_tasks(ROOT / "examples" / "tasks" / "repair.jsonl")[:3]
    async with replay_server(tasks) as server, Router(server.url) as router:
        args = miles_args(router.url, local_daemon.address)  # corral_tokenizer unset: Miles' tokenizer
        state = miles_state(args)
        try:
            outputs = await asyncio.gather(
                *[
                    adapter.generate(GenerateFnInput(state, dataset_sample(task, i), dict(SAMPLING), False))
                    for i, task in enumerate(tasks)
                ]
            )
            legacy_args = miles_args(router.url, local_daemon.address, corral_tokenizer="byte")
            legacy = await asyncio.gather(
                *[
                    adapter.generate_legacy(legacy_args, dataset_sample(task, i), dict(SAMPLING))
                    for i, task in enumerate(tasks)
                ]
            )
        finally:
            await adapter.DEFAULT_ROLLOUTS.close()

    assert len(corral_results) == 2 * len(tasks)
    for task, output, legacy_sample in zip(tasks, outputs, legacy):
        assert isinstance(output, GenerateFnOutput)
        sample = output.samples
        assert isinstance(sample, Sample)
        result = corral_results[sample.metadata["corral_rollout_id"]]
        assert result.task_id == task.task_id and result.status == "completed" and is_token_exact(result)
        assert_filled_like(sample, result)
        assert sample.reward == result.reward == 1.0 and sample.status is Sample.Status.COMPLETED
        assert len(sample.weight_versions) == len(result.turns) >= 2 and set(sample.weight_versions) == {"0"}
        assert adapter.task_for_sample(Sample(metadata=sample.metadata)) == task
        assert sample.metadata["corral_rollout_id"].startswith(task.task_id + "/")
        assert sample.metadata["corral_status"] == "completed"
        assert sample.metadata["corral_finish_reason"] == "submitted"
        assert sample.metadata["corral_filter_reason"] is None and sample.metadata["corral_error"] is None
        # The legacy form fills its sample the same way. (Observations hold test timings, so two
        # rollouts of one task differ in a few tokens: each sample is checked against its own.)
        legacy_result = corral_results[legacy_sample.metadata["corral_rollout_id"]]
        assert legacy_result.task_id == task.task_id and legacy_result.rollout_id != result.rollout_id
        assert_filled_like(legacy_sample, legacy_result)
        assert (legacy_sample.status, legacy_sample.reward, legacy_sample.weight_versions) == (
            sample.status,
            sample.reward,
            sample.weight_versions,
        )
        assert legacy_sample.tokens[: len(result.prompt_ids)] == result.prompt_ids
        assert {**legacy_sample.metadata, "corral_rollout_id": None} == {**sample.metadata, "corral_rollout_id": None}
    # Every /generate carried its rollout's id as the routing key: one per turn.
    assert Counter(router.routing_keys) == Counter(
        result.rollout_id for result in corral_results.values() for _ in result.turns
    )
    for task in tasks:
        assert not await labelled_sandboxes(local_daemon.address, task.task_id)


async def test_a_prompt_from_the_sample_is_used_verbatim(local_daemon) -> None:
    task = repair_task("miles-prompt")
    user = "[miles-prompt] add() in calc.py is wrong; fix it."
    prompt = [
        {"role": "system", "content": "You repair Python code."},
        {"role": "user", "content": user + " Keep {file} and {{x}} as written."},
    ]
    bare = repair_task("miles-prompt")
    del bare.prompt.messages[:]
    runtime = adapter.MilesRollouts()
    async with replay_server([task]) as server:
        args = miles_args(server.url, local_daemon.address, corral_tokenizer="byte")
        try:
            output = await runtime.generate(
                GenerateFnInput(miles_state(args), sample_for(bare, prompt=prompt), dict(SAMPLING), False)
            )
        finally:
            await runtime.close()
    sample = output.samples
    sample.validate()
    assert sample.reward == 1.0 and sample.status is Sample.Status.COMPLETED
    prompt_text = ByteChatTokenizer().decode(sample.tokens[: -sample.response_length])
    assert user + " Keep {file} and {{x}} as written." in prompt_text


async def test_a_filtered_rollout_is_an_aborted_sample_with_its_reason(local_daemon) -> None:
    task = repair_task("miles-bad-image")
    task.image = "/nonexistent/rootfs"
    runtime = adapter.MilesRollouts()
    async with replay_server([task]) as server:
        args = miles_args(server.url, local_daemon.address, corral_tokenizer="byte")
        try:
            output = await runtime.generate(GenerateFnInput(miles_state(args), sample_for(task), dict(SAMPLING), False))
        finally:
            await runtime.close()
    sample = output.samples
    sample.validate()
    assert sample.status is Sample.Status.ABORTED and sample.reward is None
    assert sample.metadata["corral_status"] == "filtered"
    assert sample.metadata["corral_filter_reason"] == "sandbox_start" and sample.metadata["corral_error"]
    assert len(sample.loss_mask) == sample.response_length == len(sample.rollout_log_probs)
    assert not await labelled_sandboxes(local_daemon.address, task.task_id)


async def test_an_engine_abort_filters_the_rollout(local_daemon) -> None:
    task = repair_task("miles-engine-abort")
    runtime = adapter.MilesRollouts()
    async with replay_server([task]) as server, Router(server.url, abort=True) as router:
        args = miles_args(router.url, local_daemon.address, corral_tokenizer="byte")
        try:
            output = await runtime.generate(GenerateFnInput(miles_state(args), sample_for(task), dict(SAMPLING), False))
        finally:
            await runtime.close()
    sample = output.samples
    sample.validate()
    assert sample.status is Sample.Status.ABORTED and sample.reward is None
    assert sample.metadata["corral_filter_reason"] == "llm_unreachable"
    assert "aborted the generation" in sample.metadata["corral_error"]
    assert not await labelled_sandboxes(local_daemon.address, task.task_id)


async def _wait_for_sandbox(address: str, task_id: str) -> None:
    for _ in range(400):
        if await labelled_sandboxes(address, task_id):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no sandbox for {task_id}")


async def test_cancelling_generate_or_a_miles_abort_releases_the_sandbox(local_daemon) -> None:
    cancelled, aborted = repair_task("miles-cancel"), repair_task("miles-abort")
    runtime = adapter.MilesRollouts(abort_poll_s=0.05)
    async with replay_server([cancelled, aborted], latency_s=30.0) as server:
        args = miles_args(server.url, local_daemon.address, corral_tokenizer="byte")
        state = miles_state(args)
        try:
            running = asyncio.create_task(runtime.generate(GenerateFnInput(state, sample_for(cancelled), {}, False)))
            await _wait_for_sandbox(local_daemon.address, cancelled.task_id)
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            assert not await labelled_sandboxes(local_daemon.address, cancelled.task_id)

            running = asyncio.create_task(runtime.generate(GenerateFnInput(state, sample_for(aborted), {}, False)))
            await _wait_for_sandbox(local_daemon.address, aborted.task_id)
            state.aborted = True  # Miles ends the step
            sample = (await asyncio.wait_for(running, 30)).samples
            assert not await labelled_sandboxes(local_daemon.address, aborted.task_id)
            # Once aborted, a new sample is not started at all.
            late = (await runtime.generate(GenerateFnInput(state, sample_for(aborted, 1), {}, False))).samples
        finally:
            await runtime.close()
    for s in (sample, late):
        s.validate()
        assert s.status is Sample.Status.ABORTED and s.reward is None and s.tokens == [] and s.response_length == 0
        assert "aborted" in s.metadata["corral_error"]


async def test_service_mode_runs_the_rollout_in_the_daemon(local_daemon, corral_results) -> None:
    tasks = [repair_task("miles-service-1"), repair_task("miles-service-2")]
    runtime = adapter.MilesRollouts()
    async with replay_server(tasks) as server:
        args = miles_args(server.url, local_daemon.address, corral_max_staleness=4)
        state = miles_state(args)
        try:
            outputs = await asyncio.gather(
                *[
                    runtime.service_generate(GenerateFnInput(state, sample_for(task, i), dict(SAMPLING), False))
                    for i, task in enumerate(tasks)
                ]
            )
            async with AsyncClient(local_daemon.address) as client:
                assert server.url in [llm.address for llm in await client.rollouts.list_llms()]
        finally:
            await runtime.close()
            async with AsyncClient(local_daemon.address) as client:
                for llm in await client.rollouts.list_llms():
                    await client.rollouts.remove_llm(llm.address)
    assert len(corral_results) == len(tasks)
    for task, output in zip(tasks, outputs):
        sample = output.samples
        result = corral_results[sample.metadata["corral_rollout_id"]]
        assert result.task_id == task.task_id and is_token_exact(result)
        assert_filled_like(sample, result)
        assert sample.reward == 1.0 and sample.status is Sample.Status.COMPLETED
        assert len(sample.weight_versions) == len(result.turns) >= 2
        assert not await labelled_sandboxes(local_daemon.address, task.task_id)
