"""The agent loop and the sandbox toolbox.

- Token exactness with a real BPE tokenizer (trained here, offline) and a Qwen-style chat template:
  the trajectory is exactly the prompt ids, then per turn the ids the LLM returned and the ids the
  loop appended, even where re-tokenizing the chat would give other ids.
- Loop behaviour (ending reasons, format errors, limits, cancellation) with the byte tokenizer.
- SandboxToolBox against a real daemon on the local backend.

Where decode(trajectory) and the template's rendering of the final messages can differ (so the
tests do not claim it): a generation ended by a different end-of-turn token than the template's
closing (e.g. <|endoftext|> instead of <|im_end|>); a template that rewrites history (drops
<think>); text in a message that is itself a special token's string.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from corral.rollout.agent_loop import AgentLimits, AgentLoop
from corral.rollout.tokenizer import ByteChatTokenizer, HFChatTokenizer, load_tokenizer
from corral.rollout.tool_calls import ToolCallFormat, render_tool_calls
from corral.rollout.tools import TOOL_SPECS, SandboxToolBox, cut_middle, tool_instructions
from corral.rollout.types import (
    NO_WEIGHT_VERSION,
    FinishReason,
    Generation,
    LLMUnavailable,
    SamplingOptions,
    SandboxFailure,
    ToolCall,
    ToolName,
    ToolResult,
    Trajectory,
)
from corral.sdk import AsyncClient
from tests.unit.test_rollout_tokenizer import QWEN_TEMPLATE, THINK_STRIPPING_TEMPLATE, make_hf_tokenizer_dir

HERMES = ToolCallFormat.HERMES
PROMPT = [
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": "Fix the failing test in main.py."},
]


def hermes(*calls: ToolCall) -> str:
    return render_tool_calls(list(calls), HERMES)


def bash(command: str) -> ToolCall:
    return ToolCall("bash", {"command": command})


SUBMIT = ToolCall("submit", {})


@dataclass
class Reply:
    ids: list[int]
    finish: str = "stop"
    weight_version: int | None = 7


class ScriptedLLM:
    """A GenerateFn that returns scripted ids and records what it was asked."""

    def __init__(self, replies: list[Reply] | Callable[[int], Reply]) -> None:
        self.replies = replies
        self.prompts: list[list[int]] = []
        self.samplings: list[SamplingOptions] = []
        self.rollout_ids: list[str] = []
        self.returned: list[Generation] = []

    async def __call__(self, prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str) -> Generation:
        index = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        self.samplings.append(sampling)
        self.rollout_ids.append(rollout_id)
        reply = self.replies(index) if callable(self.replies) else self.replies[index]
        logprobs = [-((index + k) % 7 + 1) / 10 for k in range(len(reply.ids))]
        generation = Generation(list(reply.ids), logprobs, reply.finish, reply.weight_version, server="fake:1")
        self.returned.append(generation)
        return generation


class StandInToolBox:
    """Stands in for SandboxToolBox where the test is about the loop or tokenization: every call
    but submit returns the next scripted observation (or echoes the call)."""

    def __init__(
        self,
        observations: list[str] | None = None,
        tools: frozenset[str] = frozenset({"bash", "python", "editor", "submit"}),
    ) -> None:
        self.tools = tools
        self.observations = list(observations) if observations is not None else None
        self.calls: list[ToolCall] = []

    async def call(self, call: ToolCall, timeout_s: float) -> ToolResult:
        self.calls.append(call)
        if call.name == "submit":
            return ToolResult("", submitted=True)
        if self.observations is None:
            return ToolResult(f"ran {call.arguments_json()}")
        return ToolResult(self.observations.pop(0))


def limits(**overrides) -> AgentLimits:
    values = dict(max_turns=30, max_new_tokens_per_turn=4096, max_total_tokens=1 << 20, action_timeout_s=10.0)
    return AgentLimits(**{**values, **overrides})


def make_loop(tokenizer, llm, tools, *, fmt=HERMES, policy_version=lambda: 42, on_turn=None, **limit_overrides):
    return AgentLoop(
        tokenizer,
        llm,
        tools,
        limits=limits(**limit_overrides),
        tool_call_format=fmt,
        sampling=SamplingOptions(max_new_tokens=1, temperature=0.7, stop_token_ids=(99999,)),
        rollout_id="r-1",
        policy_version=policy_version,
        on_turn=on_turn,
    )


def assert_aligned(trajectory: Trajectory, llm: ScriptedLLM) -> None:
    """The trajectory is the prompt, then per turn the returned ids and the appended observation
    ids; each generate call got exactly the sequence so far; masks, logprobs and weight versions
    line up with it."""
    expected = list(trajectory.prompt_ids)
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    assert len(llm.returned) == len(trajectory.turns)
    for turn, prompt, generation in zip(trajectory.turns, llm.prompts, llm.returned):
        assert prompt == expected
        assert turn.generated_ids == generation.output_ids
        version = turn.weight_version
        assert version == (generation.weight_version if generation.weight_version is not None else 42)
        expected += generation.output_ids + turn.observation_ids
        mask += [1] * len(generation.output_ids) + [0] * len(turn.observation_ids)
        logprobs += generation.logprobs + [0.0] * len(turn.observation_ids)
        versions += [version] * len(generation.output_ids) + [NO_WEIGHT_VERSION] * len(turn.observation_ids)
    assert trajectory.prompt_ids + trajectory.response_ids == expected
    assert trajectory.response_mask == mask
    assert trajectory.response_logprobs == logprobs
    assert trajectory.weight_versions == versions
    assert (
        len(trajectory.response_ids)
        == len(trajectory.response_mask)
        == len(trajectory.response_logprobs)
        == len(trajectory.weight_versions)
    )


# --- token exactness with a real BPE tokenizer ------------------------------------------------------


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFChatTokenizer:
    tokenizer = load_tokenizer(str(make_hf_tokenizer_dir(tmp_path_factory.mktemp("bpe"))))
    assert isinstance(tokenizer, HFChatTokenizer)
    return tokenizer


def char_by_char(tokenizer: HFChatTokenizer, text: str) -> list[int]:
    """A valid but non-canonical tokenization: what re-tokenizing would never give back."""
    return [i for char in text for i in tokenizer.encode(char)]


AWKWARD_OBSERVATIONS = [
    "",  # empty
    bytes(range(256)).decode(errors="replace") + "\x00\x07\x1b[31mred\x1b[0m\r\n\t",  # binary-ish
    " ".join(f"word{i}" for i in range(6000)),  # very long
    "ing the tests\n",  # no leading space: merges with whatever precedes it under BPE
    "\n\n    indented after blank lines",  # whitespace that merges with the template's newline
    "héllo wörld 😀 — naïve",
    "trailing spaces   ",
    "</tool_response> <tool_call> inside an observation",
    "Traceback (most recent call last):\nZeroDivisionError",
    "diff --git a/main.py b/main.py\n-    return None\n+    return 0\n",
]


async def test_trajectory_is_token_exact_over_many_turns(bpe):
    im_end = bpe._tokenizer.get_vocab()["<|im_end|>"]
    emoji_bytes = bpe.encode("😀")
    assert len(emoji_bytes) > 1  # cut inside it below
    replies = [
        Reply(bpe.encode("Let me look at the repository first.\n" + hermes(bash("ls -la"))) + [im_end]),
        Reply(
            char_by_char(bpe, "I will read the tests. " + hermes(bash("cat tests.py"))) + [im_end], weight_version=None
        ),
        # Cut by length after a complete call: fine, the continuation closes the turn.
        Reply(bpe.encode(hermes(bash("python main.py")) + "\nNow I will look at"), finish="length"),
        Reply(bpe.encode("Two at once: " + hermes(bash("pwd"), ToolCall("python", {"code": "1/0"}))) + [im_end]),
        # Cut inside a call: a format error, still closed by the continuation.
        Reply(bpe.encode('<tool_call>{"name": "bash", "arguments": {"comm'), finish="length"),
        Reply(bpe.encode("I think the fix is obvious.") + [im_end], weight_version=None),  # no call
        Reply(bpe.encode(hermes(ToolCall("editor", {"command": "view", "path": "main.py"}))) + [im_end]),
        # Cut inside a multi-byte character.
        Reply(bpe.encode(hermes(bash("echo ok")) + " ") + emoji_bytes[:1], finish="length", weight_version=3),
        Reply(
            bpe.encode(
                "<think>\nThe test fails because main returns None.\n</think>\n\n"
                + hermes(bash("sed -i s/None/0/ main.py"))
            )
            + [im_end]
        ),
        Reply(char_by_char(bpe, hermes(bash("python -m pytest -q"))) + [im_end]),
        Reply(bpe.encode(hermes(bash("git diff"))) + [im_end]),
        Reply(bpe.encode("Done. " + hermes(SUBMIT)) + [im_end]),
    ]
    llm = ScriptedLLM(replies)
    tools = StandInToolBox(AWKWARD_OBSERVATIONS)
    loop = make_loop(bpe, llm, tools)
    trajectory = await loop.run(PROMPT)

    assert trajectory.finish_reason is FinishReason.SUBMITTED
    assert len(trajectory.turns) == len(replies) == 12
    assert tools.observations == []  # every awkward observation went in
    assert [turn.format_error for turn in trajectory.turns] == [False] * 4 + [True, True] + [False] * 6
    assert_aligned(trajectory, llm)
    # The observation ids are the template's text after each turn, tokenized alone.
    chat = trajectory.messages[len(PROMPT) :]
    starts = [i for i, message in enumerate(chat) if message["role"] == "assistant"]
    for turn, generation, start, end in zip(trajectory.turns, llm.returned, starts, starts[1:]):
        assert chat[start]["content"] == bpe.decode([i for i in generation.output_ids if i != im_end])
        body = "".join(f"\n<tool_response>\n{m['content']}\n</tool_response>" for m in chat[start + 1 : end])
        closing = "\n" if generation.output_ids[-1] == im_end else "<|im_end|>\n"
        text = f"{closing}<|im_start|>user{body}<|im_end|>\n<|im_start|>assistant\n"
        assert bpe.decode(turn.observation_ids) == text
        assert turn.observation_ids == bpe.encode(text)
    # Non-canonical generated ids were kept as generated, not re-tokenized.
    second = trajectory.turns[1].generated_ids
    assert second != bpe.encode(bpe.decode(second[:-1])) + [im_end]
    assert trajectory.turns[-1].observation_ids == []  # nothing after submit
    # The whole sequence reads as the template's rendering of the final chat, cut turns included
    # (the continuation wrote their <|im_end|>); the last turn ends at its own <|im_end|>.
    whole = bpe.decode(trajectory.prompt_ids + trajectory.response_ids)
    expected = (
        bpe.render(trajectory.messages[:-1], add_generation_prompt=True)
        + trajectory.messages[-1]["content"]
        + "<|im_end|>"
    )
    assert whole == expected
    assert bpe.render(trajectory.messages, add_generation_prompt=False) == expected + "\n"
    assert trajectory.messages[0]["content"].startswith("You are a careful agent.\n\n# Tools")


async def test_exact_tokens_when_the_template_rewrites_history(tmp_path):
    """A Qwen3-like template drops <think> from earlier turns, so the continuation comes from the
    fixed delta; the sequence still reads as the chat with the thinking kept."""
    tokenizer = HFChatTokenizer(make_hf_tokenizer_dir(tmp_path / "think", THINK_STRIPPING_TEMPLATE))
    plain = HFChatTokenizer(make_hf_tokenizer_dir(tmp_path / "plain", QWEN_TEMPLATE))
    im_end = tokenizer._tokenizer.get_vocab()["<|im_end|>"]
    think = "<think>\nThe test fails.\n</think>\n\n"
    replies = [
        Reply(tokenizer.encode(think + hermes(bash("ls"))) + [im_end]),
        Reply(tokenizer.encode(think + hermes(bash("cat main.py"))), finish="length"),
        Reply(tokenizer.encode(hermes(bash("pwd"))) + [im_end]),
        Reply(tokenizer.encode(think + hermes(SUBMIT)) + [im_end]),
    ]
    llm = ScriptedLLM(replies)
    trajectory = await make_loop(tokenizer, llm, StandInToolBox(["a.py", "print(1)", "/workspace"])).run(PROMPT)
    assert trajectory.finish_reason is FinishReason.SUBMITTED
    assert_aligned(trajectory, llm)
    whole = tokenizer.decode(trajectory.prompt_ids + trajectory.response_ids)
    assert whole.count("<think>") == 3
    assert (
        whole
        == plain.render(trajectory.messages[:-1], add_generation_prompt=True)
        + trajectory.messages[-1]["content"]
        + "<|im_end|>"
    )


# --- loop behaviour (byte tokenizer) ----------------------------------------------------------------

BYTES = ByteChatTokenizer()
IM_END = BYTES.special_ids["<|im_end|>"]


def byte_reply(text: str, *, end: bool = True, weight_version: int | None = 7) -> Reply:
    return Reply(BYTES.encode(text) + ([IM_END] if end else []), "stop" if end else "length", weight_version)


async def test_submit_ends_the_episode_and_calls_after_it_do_not_run():
    llm = ScriptedLLM(
        [byte_reply(hermes(bash("ls"))), byte_reply(hermes(bash("echo before"), SUBMIT, bash("echo after")))]
    )
    tools = StandInToolBox()
    trajectory = await make_loop(BYTES, llm, tools).run(PROMPT)
    assert trajectory.finish_reason is FinishReason.SUBMITTED
    assert [call.arguments.get("command") for call in tools.calls] == ["ls", "echo before", None]
    assert trajectory.turns[-1].observation_ids == []
    assert trajectory.response_ids[-1] == IM_END  # ends with the generated ids
    assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert len(trajectory.turns[-1].tool_calls) == 3
    assert_aligned(trajectory, llm)


async def test_max_turns_and_the_final_turn_has_no_observation():
    llm = ScriptedLLM(lambda i: byte_reply(hermes(bash(f"echo {i}"))))
    tools = StandInToolBox()
    trajectory = await make_loop(BYTES, llm, tools, max_turns=3).run(PROMPT)
    assert trajectory.finish_reason is FinishReason.MAX_TURNS
    assert len(llm.prompts) == len(trajectory.turns) == 3
    assert len(tools.calls) == 3  # the last turn's call ran (it may matter for evaluation)
    assert [bool(turn.observation_ids) for turn in trajectory.turns] == [True, True, False]
    assert trajectory.messages[-1]["role"] == "assistant"
    assert_aligned(trajectory, llm)


async def test_context_full_caps_new_tokens_and_never_exceeds_the_total():
    tools = StandInToolBox()
    system = {"role": "system", "content": PROMPT[0]["content"] + "\n\n" + tool_instructions(tools.tools, HERMES)}
    prompt_length = len(BYTES.encode_prompt([system, *PROMPT[1:]]))
    total = prompt_length + 300
    text = hermes(bash("echo " + "x" * 40))

    def reply(index: int) -> Reply:
        sampling = llm.samplings[index]
        ids = BYTES.encode(text) + [IM_END]
        return Reply(ids[: sampling.max_new_tokens], "stop" if len(ids) <= sampling.max_new_tokens else "length")

    llm = ScriptedLLM(reply)
    trajectory = await make_loop(BYTES, llm, tools, max_total_tokens=total, max_new_tokens_per_turn=100).run(PROMPT)
    assert trajectory.finish_reason is FinishReason.CONTEXT_FULL
    assert len(trajectory.prompt_ids) == prompt_length
    for prompt, sampling in zip(llm.prompts, llm.samplings):
        assert sampling.max_new_tokens == min(100, total - len(prompt))
    assert len(trajectory.prompt_ids) + len(trajectory.response_ids) <= total
    assert trajectory.turns[-1].observation_ids == []
    assert_aligned(trajectory, llm)


async def test_prompt_longer_than_the_context_ends_before_any_generation():
    llm = ScriptedLLM([])
    trajectory = await make_loop(BYTES, llm, StandInToolBox(), max_total_tokens=50).run(PROMPT)
    assert trajectory.finish_reason is FinishReason.CONTEXT_FULL
    assert llm.prompts == [] and trajectory.turns == [] and trajectory.response_ids == []


async def test_consecutive_format_errors_end_as_unparsable():
    texts = [
        "no call here",
        '<tool_call>{"name": "bash"',
        hermes(bash("ls")),  # the valid call resets the count
        "still nothing",
        "<tool_call>not json</tool_call>",
        "and again",
    ]
    llm = ScriptedLLM([byte_reply(t) for t in texts])
    trajectory = await make_loop(BYTES, llm, StandInToolBox()).run(PROMPT)
    assert trajectory.finish_reason is FinishReason.UNPARSABLE
    assert [turn.format_error for turn in trajectory.turns] == [True, True, False, True, True, True]
    assert trajectory.format_errors == 5
    observations = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert observations[0].startswith("Error: your reply has no tool call.")
    assert "<tool_call>{" in observations[0]  # tells the model how to call a tool
    assert "could not be read: <tool_call> is not closed" in observations[1]
    assert "not valid JSON" in observations[4]
    assert_aligned(trajectory, llm)


async def test_fenced_bash_format_errors_explain_the_block():
    llm = ScriptedLLM([byte_reply("I would run ls."), byte_reply("```bash\nls\n```"), byte_reply("SUBMIT")])
    tools = StandInToolBox()
    trajectory = await make_loop(BYTES, llm, tools, fmt=ToolCallFormat.FENCED_BASH).run(PROMPT)
    assert trajectory.finish_reason is FinishReason.SUBMITTED
    assert "```bash block" in trajectory.messages[3]["content"]
    assert tools.calls == [bash("ls\n"), SUBMIT]
    assert "```bash" in trajectory.messages[0]["content"] and "SUBMIT" in trajectory.messages[0]["content"]


async def test_system_prompt_gets_the_tool_instructions():
    llm = ScriptedLLM([byte_reply(hermes(SUBMIT))] * 2)
    tools = StandInToolBox(tools=frozenset({"bash", "submit"}))
    user_only = [{"role": "user", "content": "hi"}]
    trajectory = await make_loop(BYTES, llm, tools).run(user_only)
    assert user_only == [{"role": "user", "content": "hi"}]  # the caller's list is left alone
    assert trajectory.messages[0] == {"role": "system", "content": tool_instructions(tools.tools, HERMES)}
    instructions = trajectory.messages[0]["content"]
    assert '"name": "bash"' in instructions and '"name": "submit"' in instructions
    assert '"name": "python"' not in instructions and "<tool_call>" in instructions
    trajectory = await make_loop(BYTES, ScriptedLLM([byte_reply(hermes(SUBMIT))]), tools).run(PROMPT)
    assert trajectory.messages[0]["content"] == "You are a careful agent.\n\n" + instructions


async def test_sampling_stop_ids_rollout_id_and_clipping():
    # The server returns more ids than asked: the loop keeps max_new_tokens of them.
    llm = ScriptedLLM([byte_reply(hermes(bash("ls")) + "x" * 50), byte_reply(hermes(SUBMIT))])
    trajectory = await make_loop(BYTES, llm, StandInToolBox(), max_new_tokens_per_turn=60).run(PROMPT)
    sampling = llm.samplings[0]
    assert sampling.stop_token_ids == (99999, *BYTES.end_of_turn_ids)
    assert sampling.temperature == 0.7 and sampling.max_new_tokens == 60
    assert llm.rollout_ids == ["r-1", "r-1"]
    first = trajectory.turns[0]
    assert len(first.generated_ids) == len(first.generated_logprobs) == 60
    assert first.llm_finish_reason == "length" and first.llm_server == "fake:1"


async def test_weight_version_falls_back_to_the_policy_version_and_on_turn_sees_each_turn():
    llm = ScriptedLLM(
        [
            byte_reply(hermes(bash("a")), weight_version=None),
            byte_reply(hermes(bash("b")), weight_version=5),
            byte_reply(hermes(SUBMIT), weight_version=None),
        ]
    )
    versions = iter([11, 12])
    seen = []
    loop = make_loop(
        BYTES,
        llm,
        StandInToolBox(),
        policy_version=lambda: next(versions),
        on_turn=lambda turn: seen.append((turn.index, turn.weight_version, len(loop.trajectory.turns))),
    )
    trajectory = await loop.run(PROMPT)
    assert [turn.weight_version for turn in trajectory.turns] == [11, 5, 12]
    # on_turn runs once per turn, after the turn is in the trajectory.
    assert seen == [(0, 11, 1), (1, 5, 2), (2, 12, 3)]
    assert set(trajectory.weight_versions) == {11, 5, 12, NO_WEIGHT_VERSION}
    assert trajectory.oldest_weight_version == 5


async def test_llm_unavailable_propagates_and_keeps_the_complete_turns():
    async def generate(prompt_ids, sampling, rollout_id):
        if generate.calls:
            raise LLMUnavailable("all servers down")
        generate.calls += 1
        return Generation(BYTES.encode(hermes(bash("ls"))) + [IM_END], [0.0] * (len(hermes(bash("ls"))) + 1), "stop")

    generate.calls = 0
    loop = make_loop(BYTES, generate, StandInToolBox())
    with pytest.raises(LLMUnavailable):
        await loop.run(PROMPT)
    assert len(loop.trajectory.turns) == 1 and loop.trajectory.finish_reason is None
    assert loop.trajectory.turns[0].observation_ids


async def test_a_cancelled_run_leaves_a_consistent_trajectory():
    blocked = asyncio.Event()

    class SlowTools(StandInToolBox):
        async def call(self, call, timeout_s):
            if len(self.calls) == 2:
                blocked.set()
                await asyncio.sleep(3600)  # the third tool call never finishes
            return await super().call(call, timeout_s)

    llm = ScriptedLLM(lambda i: byte_reply(hermes(bash(f"step {i}"))))
    loop = make_loop(BYTES, llm, SlowTools())
    task = asyncio.create_task(loop.run(PROMPT))
    await asyncio.wait_for(blocked.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    trajectory = loop.trajectory
    assert len(llm.prompts) == 3 and len(trajectory.turns) == 2  # the third turn is not half in
    assert trajectory.finish_reason is None  # the caller sets TIMEOUT
    assert len(trajectory.messages) == len(PROMPT) + 4
    assert BYTES.decode(trajectory.prompt_ids + trajectory.response_ids) == BYTES.render(
        trajectory.messages, add_generation_prompt=True
    )
    llm.returned.pop()  # the generation of the cancelled turn
    assert_aligned(trajectory, llm)


# --- observation truncation ---------------------------------------------------------------------------


def test_every_tool_name_has_a_spec():
    assert set(TOOL_SPECS) == {tool.value for tool in ToolName}
    for fmt in ToolCallFormat:
        assert "# Tools" in tool_instructions(TOOL_SPECS, fmt)


def test_cut_middle_keeps_head_and_tail_with_a_marker():
    assert cut_middle("short", 100) == "short"
    text = "HEAD" + "x" * 10_000 + "TAIL"
    cut = cut_middle(text, 200)
    assert cut.startswith("HEAD") and cut.endswith("TAIL") and len(cut.encode()) <= 200
    match = re.search(r"\n\[\.\.\. (\d+) bytes cut \.\.\.\]\n", cut)
    assert match and int(match.group(1)) + len(cut.encode()) - len(match.group(0)) == len(text)
    # Multi-byte characters are never cut in two.
    emoji = cut_middle("😀" * 1000, 101)
    assert "\ufffd" not in emoji and len(emoji.encode()) <= 101
    # Bytes the daemon already dropped are counted.
    counted = cut_middle("a" * 200, 64, already_cut=5000)
    kept = len(counted.encode()) - len(re.search(r"\n\[.*\]\n", counted).group(0))
    assert f"[... {200 - kept + 5000} bytes cut ...]" in counted


# --- SandboxToolBox against a real daemon -------------------------------------------------------------


@pytest.fixture
async def sandbox(local_daemon):
    async with AsyncClient(local_daemon.address) as client, await client.create_sandbox() as sb:
        yield sb


@pytest.fixture
async def toolbox(sandbox):
    box = SandboxToolBox(
        sandbox, ["bash", "python", "editor", "submit"], workdir=sandbox.info.workdir, max_observation_bytes=4096
    )
    yield box
    await box.close()


async def run(box: SandboxToolBox, name: str, timeout_s: float = 20, **arguments) -> str:
    result = await box.call(ToolCall(name, arguments), timeout_s)
    assert not result.submitted
    return result.text


async def test_bash_keeps_state_shows_exit_codes_and_times_out(toolbox, sandbox):
    assert await run(toolbox, "bash", command="pwd") == "/workspace\n"
    assert await run(toolbox, "bash", command="cd /tmp && export GREETING=hi") == "(no output)"
    assert await run(toolbox, "bash", command="echo $GREETING from $(pwd)") == "hi from /tmp\n"
    assert await run(toolbox, "bash", command="printf 'oops\\n'; (exit 3)") == "oops\n[exit code: 3]"
    started = asyncio.get_running_loop().time()
    text = await run(toolbox, "bash", timeout_s=1, command="echo start; sleep 60")
    assert asyncio.get_running_loop().time() - started < 15
    assert text.startswith("start\n[timed out after 1 s")
    assert await run(toolbox, "bash", command="echo still usable in $(pwd)") == "still usable in /tmp\n"
    # `exit` ends the shell: the daemon restarts it, and the agent is told its state is gone.
    assert "[the shell was restarted" in await run(toolbox, "bash", command="exit 3")
    assert await run(toolbox, "bash", command="pwd") == "/workspace\n"
    assert [shell.name for shell in await sandbox.list_shells()] == ["agent"]
    await toolbox.close()
    assert await sandbox.list_shells() == []


async def test_python_runs_in_a_persistent_kernel(toolbox, sandbox, kernel_python):
    assert await run(toolbox, "python", code="x = 21\nprint('set')") == "set"
    assert await run(toolbox, "python", code="x * 2") == "42"
    text = await run(toolbox, "python", code="print('before')\n1/0")
    assert text.startswith("before\n") and "ZeroDivisionError" in text and "\x1b[" not in text
    assert len(await sandbox.list_kernels()) == 1
    await toolbox.close()
    assert await sandbox.list_kernels() == []


async def test_editor_create_view_replace_insert(toolbox):
    assert (
        await run(
            toolbox, "editor", command="create", path="pkg/main.py", file_text="def f():\n    return None\n\nx = None\n"
        )
        == "Created /workspace/pkg/main.py."
    )
    assert (
        await run(toolbox, "editor", command="view", path="pkg/main.py")
        == "     1\tdef f():\n     2\t    return None\n     3\t\n     4\tx = None"
    )
    assert (
        await run(toolbox, "editor", command="view", path="pkg/main.py", view_range=[2, 2]) == "     2\t    return None"
    )
    assert await run(toolbox, "editor", command="view", path=".") == "/workspace (directory):\npkg/"
    missing = await run(toolbox, "editor", command="str_replace", path="pkg/main.py", old_str="return 1", new_str="x")
    assert missing == (
        "Error: no replacement: old_str does not occur in /workspace/pkg/main.py; it must occur exactly once"
    )
    twice = await run(toolbox, "editor", command="str_replace", path="pkg/main.py", old_str="None", new_str="0")
    assert "occurs 2 times" in twice and twice.startswith("Error: no replacement")
    edited = await run(
        toolbox, "editor", command="str_replace", path="pkg/main.py", old_str="return None", new_str="return 0"
    )
    assert edited.startswith("Edited /workspace/pkg/main.py:\n") and "     2\t    return 0" in edited
    await run(toolbox, "editor", command="insert", path="pkg/main.py", insert_line=0, new_str="import os")
    await run(toolbox, "editor", command="insert", path="pkg/main.py", insert_line=5, new_str="y = 1\n")
    assert (
        await run(toolbox, "bash", command="cat pkg/main.py")
        == "import os\ndef f():\n    return 0\n\nx = None\ny = 1\n"
    )
    bad = await run(toolbox, "editor", command="insert", path="pkg/main.py", insert_line=99, new_str="z")
    assert bad == "Error: insert_line 99 is outside the file (0 to 6)"


async def test_agent_mistakes_come_back_as_observations(toolbox):
    assert "No such file" in await run(toolbox, "editor", command="view", path="nope.txt")
    await run(toolbox, "editor", command="create", path="plain", file_text="x")
    assert "a file is where a directory should be" in await run(
        toolbox, "editor", command="create", path="plain/inner", file_text="x"
    )
    assert (
        await run(toolbox, "editor", command="rename", path="a")
        == "Error: editor: 'command' must be one of view, create, str_replace, insert"
    )
    assert await run(toolbox, "editor", command="create", path="a") == "Error: editor create needs file_text"
    assert await run(toolbox, "bash") == "Error: bash needs the argument 'command'"
    assert await run(toolbox, "bash", command=["ls"]) == "Error: bash: 'command' must be a string"
    assert await run(toolbox, "bash", command="ls", cwd="/") == "Error: bash has no argument 'cwd' (arguments: command)"
    assert (
        await run(toolbox, "browser", url="x")
        == "Error: there is no tool 'browser' (tools: bash, editor, python, submit)"
    )
    narrow = SandboxToolBox(toolbox.sandbox, ["bash", "submit"], workdir="/workspace", max_observation_bytes=100)
    assert await run(narrow, "python", code="1") == "Error: there is no tool 'python' (tools: bash, submit)"
    assert (await narrow.call(ToolCall("submit", {"answer": 1}), 5)).submitted


async def test_long_output_is_cut_with_a_marker(sandbox):
    box = SandboxToolBox(sandbox, ["bash"], workdir="/workspace", max_observation_bytes=1000)
    try:
        text = await run(box, "bash", command="python3 -c \"print('h' + 'a' * 100000 + 't')\"")
    finally:
        await box.close()
    match = re.search(r"\n\[\.\.\. (\d+) bytes cut \.\.\.\]\n", text)
    assert match and text.startswith("haaa") and text.endswith("aat\n")
    assert len(text.encode()) <= 1000
    assert int(match.group(1)) + len(text.encode()) - len(match.group(0)) == 100003


async def test_a_destroyed_sandbox_is_a_sandbox_failure(local_daemon):
    async with AsyncClient(local_daemon.address) as client:
        sandbox = await client.create_sandbox()
        box = SandboxToolBox(sandbox, ["bash", "python", "editor"], workdir="/workspace", max_observation_bytes=1000)
        await run(box, "bash", command="true")
        await sandbox.destroy()
        with pytest.raises(SandboxFailure):
            await run(box, "bash", command="ls")
        with pytest.raises(SandboxFailure):
            await run(box, "editor", command="view", path="x")
        with pytest.raises(SandboxFailure):
            await run(box, "python", code="1")
        await box.close()  # best effort: no error


async def test_agent_loop_with_a_real_sandbox(sandbox):
    texts = [
        hermes(bash("echo hello > greeting.txt && echo wrote")),
        hermes(ToolCall("editor", {"command": "view", "path": "greeting.txt"})),
        hermes(bash("seq 1 3000")),
        hermes(SUBMIT),
    ]
    llm = ScriptedLLM([byte_reply(text) for text in texts])
    box = SandboxToolBox(sandbox, ["bash", "editor", "submit"], workdir="/workspace", max_observation_bytes=512)
    try:
        trajectory = await make_loop(BYTES, llm, box).run(PROMPT)
    finally:
        await box.close()
    assert trajectory.finish_reason is FinishReason.SUBMITTED
    observations = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert observations[:2] == ["wrote\n", "     1\thello"]
    assert observations[2].startswith("1\n2\n3\n") and observations[2].endswith("2999\n3000\n")
    assert "bytes cut ...]" in observations[2]
    assert (await sandbox.read_file("greeting.txt")) == b"hello\n"
    assert BYTES.decode(trajectory.prompt_ids + trajectory.response_ids) + "\n" == BYTES.render(
        trajectory.messages, add_generation_prompt=False
    )
    assert_aligned(trajectory, llm)


async def test_a_generation_the_server_aborted_is_an_infrastructure_failure() -> None:
    """An "abort" finish (e.g. generation paused for a weight update) is not the model's turn: the
    rollout is filtered as LLM unreachable instead of continuing from a cut turn."""
    from corral.rollout.agent_loop import AgentLimits, AgentLoop
    from corral.rollout.tokenizer import ByteChatTokenizer
    from corral.rollout.tool_calls import ToolCallFormat
    from corral.rollout.types import Generation, LLMUnavailable, SamplingOptions

    async def aborting(prompt_ids, sampling, rollout_id):
        return Generation([104, 105], [-0.1, -0.2], "abort", server="http://engine")

    class NoTools:  # never reached: the loop stops at the aborted generation
        tools = frozenset({"bash", "submit"})

        async def call(self, call, timeout_s):
            raise AssertionError("no tool call expected")

    loop = AgentLoop(
        ByteChatTokenizer(),
        aborting,
        NoTools(),
        limits=AgentLimits(max_turns=3, max_new_tokens_per_turn=8, max_total_tokens=4096, action_timeout_s=5),
        tool_call_format=ToolCallFormat.HERMES,
        sampling=SamplingOptions(max_new_tokens=8),
        rollout_id="r",
        policy_version=lambda: 0,
    )
    with pytest.raises(LLMUnavailable, match="aborted"):
        await loop.run([{"role": "user", "content": "hi"}])
    assert loop.trajectory.turns == []
