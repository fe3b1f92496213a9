"""Trajectory assembly behind the gateway: a rollout's calls become token-exact samples. Prefix
hits, splices of reformatted replies, splits on rewritten histories (SPLIT, MASK, FAIL), retries,
and the limits (context, max calls), driven through a GatewaySession with a scripted LLM."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from corral.rollout.gateway import GatewaySession, HistoryPolicy, HistoryRewritten
from corral.rollout.gateway.errors import ContextLengthExceeded, MaxTurnsExceeded, Unavailable
from corral.rollout.gateway.openai_api import openai_tool_calls
from corral.rollout.gateway.render import Conversation, normalize_messages, normalize_tools
from corral.rollout.gateway.session import CallOptions
from corral.rollout.types import NO_WEIGHT_VERSION, ToolCall
from tests.unit.gateway_support import (
    BASH_TOOL,
    IM_END_ID,
    TOK,
    ScriptedLLM,
    Unreachable,
    Window,
    assert_token_exact,
    make_session,
    settings,
)


def call_text(command: str, spaced: bool = True) -> str:
    separators = (", ", ": ") if spaced else (",", ":")
    return f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': command}}, separators=separators)}</tool_call>"


class Harness:
    """An OpenAI-style tool-calling harness: it keeps the conversation as OpenAI messages, sends
    it whole on every call, and appends each reply as it came back plus one tool result."""

    def __init__(self, session: GatewaySession, *, tools: list[dict] | None = None, system: str = "Be brief.") -> None:
        self.session = session
        self.tools = [BASH_TOOL] if tools is None else tools
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": "Fix the failing test."},
        ]

    async def ask(self, **options: Any) -> dict[str, Any]:
        conversation = Conversation(normalize_messages(self.messages), normalize_tools(self.tools or None))
        result, reply = await self.session.chat(conversation, CallOptions(parse_tool_calls=bool(self.tools), **options))
        message: dict[str, Any] = {"role": "assistant", "content": reply["content"] or None}
        if reply.get("tool_calls"):
            message["tool_calls"] = openai_tool_calls(reply)
        return message

    async def step(self, observation: str = "ok") -> dict[str, Any]:
        message = await self.ask()
        self.messages.append(message)
        for call in message.get("tool_calls", []):
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": observation})
        if not message.get("tool_calls"):
            self.messages.append({"role": "user", "content": observation})
        return message


async def test_six_calls_make_one_token_exact_sample_of_prefix_hits():
    llm = ScriptedLLM([f"Step {i}.\n" + call_text(f"echo {i}") for i in range(5)] + ["All done."])
    session = make_session(llm)
    harness = Harness(session)
    for i in range(6):
        message = await harness.step(observation=f"output {i}")
    assert message == {"role": "assistant", "content": "All done."}
    outcome = session.close()
    assert len(outcome.samples) == 1
    sample = outcome.samples[0]
    assert_token_exact(sample, llm.calls)
    counters = outcome.counters
    assert (counters.calls, counters.prefix_hits, counters.splices, counters.splits) == (6, 5, 0, 0)
    # Each call's prompt is the full rendering of what the harness sent (the byte template's
    # tools block included), and the engine stopped on the template's end of turn.
    assert TOK.decode(llm.calls[-1].prompt_ids).count("<tools>\n") == 1
    assert all(IM_END_ID in call.stop_token_ids for call in llm.calls)
    assert [turn.tool_calls for turn in sample.turns][:2] == [
        [ToolCall("bash", {"command": "echo 0"})],
        [ToolCall("bash", {"command": "echo 1"})],
    ]
    assert sample.turns[-1].observation_ids == []  # the last reply has no observation
    assert {v for v, m in zip(sample.weight_versions, sample.response_mask) if m} == {7}
    assert {v for v, m in zip(sample.weight_versions, sample.response_mask) if not m} == {NO_WEIGHT_VERSION}
    assert sample.messages[-1] == {"role": "assistant", "content": "All done."}
    assert sample.finish_reason is None


async def test_a_reply_sent_back_reformatted_is_spliced_from_the_recorded_ids():
    # The model writes compact JSON; the harness sends the call back with arguments as a spaced
    # JSON string and content None, so the full re-rendering differs from what was generated.
    llm = ScriptedLLM([call_text("ls", spaced=False), call_text("cat a", spaced=False), "Done."])
    session = make_session(llm)
    harness = Harness(session)
    first = await harness.step()
    assert first["content"] is None
    assert json.loads(first["tool_calls"][0]["function"]["arguments"]) == {"command": "ls"}
    first["tool_calls"][0]["function"]["arguments"] = '{ "command" :  "ls" }'
    second = await harness.step()
    second["content"] = ""  # "" and None are the same content
    await harness.step()
    outcome = session.close()
    assert (outcome.counters.splices, outcome.counters.prefix_hits, outcome.counters.splits) == (2, 0, 0)
    assert len(outcome.samples) == 1
    assert_token_exact(outcome.samples[0], llm.calls)
    # What the model generated is what was sent on, not a re-tokenization of the resent JSON.
    assert TOK.encode(call_text("ls", spaced=False)) + [IM_END_ID] == outcome.samples[0].turns[0].generated_ids


async def test_a_truncated_history_starts_a_second_exact_sample():
    llm = ScriptedLLM([call_text(f"step {i}") for i in range(5)])
    session = make_session(llm)
    harness = Harness(session)
    for _ in range(3):
        await harness.step()
    # The harness drops the middle of the conversation (keeps system, user, last exchange).
    harness.messages = harness.messages[:2] + harness.messages[-2:]
    await harness.step()
    await harness.step()
    outcome = session.close()
    assert len(outcome.samples) == 2
    assert_token_exact(outcome.samples[0], llm.calls[:3])
    assert_token_exact(outcome.samples[1], llm.calls[3:])
    assert outcome.samples[0].turns[-1].observation_ids == []  # closed without an observation
    assert (outcome.counters.splits, outcome.counters.prefix_hits, outcome.counters.masked_samples) == (1, 3, 0)
    assert all(1 in sample.response_mask for sample in outcome.samples)


async def test_mask_policy_delivers_every_sample_with_mask_zero_when_the_history_was_rewritten():
    llm = ScriptedLLM([call_text("a"), call_text("b"), call_text("c")])
    session = make_session(llm, settings(HistoryPolicy.MASK))
    harness = Harness(session)
    await harness.step()
    await harness.step()
    harness.messages[0]["content"] = "A different system prompt."
    await harness.step()
    outcome = session.close()
    assert len(outcome.samples) == 2
    assert all(set(sample.response_mask) == {0} for sample in outcome.samples)
    assert outcome.counters.masked_samples == 2 and outcome.counters.splits == 1
    # The ids are still exact (only the mask is cleared).
    assert outcome.samples[1].prompt_ids + outcome.samples[1].response_ids == (
        llm.calls[2].prompt_ids + llm.calls[2].generation.output_ids
    )


async def test_mask_policy_keeps_a_single_sample_trainable():
    llm = ScriptedLLM([call_text("a"), "done"])
    session = make_session(llm, settings(HistoryPolicy.MASK))
    harness = Harness(session)
    await harness.step()
    await harness.step()
    outcome = session.close()
    assert outcome.counters.masked_samples == 0
    assert_token_exact(outcome.samples[0], llm.calls)


def _drop_tools(harness: Harness) -> None:
    harness.tools = []


def _edit_the_reply(harness: Harness) -> None:
    harness.messages[-2]["tool_calls"][0]["function"]["arguments"] = '{"command": "rm -rf /"}'


@pytest.mark.parametrize(
    ("rewrite", "reason"),
    [(_drop_tools, "the tools differ"), (_edit_the_reply, r"messages\[2\] is not the assistant reply")],
)
async def test_fail_policy_refuses_the_rewritten_call_and_every_later_one(rewrite, reason):
    llm = ScriptedLLM([call_text("a"), call_text("b")])
    session = make_session(llm, settings(HistoryPolicy.FAIL))
    harness = Harness(session)
    await harness.step()
    rewrite(harness)
    with pytest.raises(HistoryRewritten, match=reason) as refused:
        await harness.step()
    assert refused.value.status == 409
    assert session.outcome.history_rewritten is not None  # known before the session closes
    harness.messages = harness.messages[:2]  # even a fresh start is refused now
    with pytest.raises(HistoryRewritten):
        await harness.step()
    outcome = session.close()
    assert outcome.history_rewritten is not None and re.search(reason, outcome.history_rewritten)
    assert len(llm.calls) == 1 and outcome.counters.calls == 1
    assert_token_exact(outcome.samples[0], llm.calls)


async def test_asking_the_same_conversation_again_discards_the_first_reply():
    llm = ScriptedLLM([call_text("a"), call_text("b"), call_text("c"), "done"])
    session = make_session(llm)
    harness = Harness(session)
    await harness.step()
    dropped = await harness.ask()  # the harness did not like this reply and asks again
    assert dropped["tool_calls"][0]["function"]["arguments"] == '{"command": "b"}'
    await harness.step()
    await harness.step()
    outcome = session.close()
    assert llm.calls[1].prompt_ids == llm.calls[2].prompt_ids
    assert outcome.counters.discarded == 1 and outcome.counters.splits == 0
    assert len(outcome.samples) == 1
    assert_token_exact(outcome.samples[0], [llm.calls[0], llm.calls[2], llm.calls[3]])


async def test_a_prompt_without_room_is_refused_and_the_sample_is_kept_as_it_was():
    llm = ScriptedLLM([call_text("a" * 40), call_text("b")])
    window = Window()
    session = make_session(llm, settings(max_total_tokens=10_000), window=window)
    harness = Harness(session)
    await harness.step(observation="x")
    first_prompt_len = len(llm.calls[0].prompt_ids)
    # The next prompt is longer than the first call's prompt and output: refuse it under a
    # window that the first call fits in with room to spare.
    window.tokens = first_prompt_len + len(llm.calls[0].generation.output_ids) + 5
    with pytest.raises(ContextLengthExceeded) as refused:
        await harness.step()
    assert refused.value.code == "context_length_exceeded" and refused.value.status == 400
    outcome = session.close()
    assert outcome.context_full
    assert len(outcome.samples) == 1 and outcome.counters.calls == 1
    assert outcome.samples[0].turns[0].observation_ids == []  # the refused call added nothing
    assert_token_exact(outcome.samples[0], llm.calls)


async def test_max_new_tokens_is_the_smallest_of_the_request_the_turn_cap_and_the_room_left():
    llm = ScriptedLLM(["a long reply " * 20])
    session = make_session(llm, settings(max_new_tokens_per_turn=50, max_total_tokens=10_000))
    harness = Harness(session, tools=[])
    await harness.ask(max_tokens=30)
    await harness.ask(max_tokens=80)
    assert [call.max_new_tokens for call in llm.calls] == [30, 50]
    prompt_len = len(llm.calls[0].prompt_ids)
    session.settings = settings(max_new_tokens_per_turn=50, max_total_tokens=prompt_len + 9)
    await harness.ask()
    assert llm.calls[-1].max_new_tokens == 9
    assert llm.calls[-1].generation.finish_reason == "length"
    # The task's stop strings hold, and a request's are added.
    await harness.ask(stop=("END",))
    assert llm.calls[-1].stop == ("STOP!", "END")


async def test_the_stop_string_a_reply_ended_on_is_not_in_its_content_but_stays_in_the_ids():
    llm = ScriptedLLM(["Thinking... END"])
    session = make_session(llm)
    message = await Harness(session, tools=[]).ask(stop=("END",))
    assert message["content"] == "Thinking... "
    assert TOK.decode(session.close().samples[0].response_ids) == "Thinking... END<|im_end|>"


async def test_the_content_ends_where_the_stop_string_begins_when_the_last_token_runs_past_it():
    # A real engine stops on the token that completes the stop string, and a multi-character
    # token carries text past it: the tiny Qwen2 model's " developer" completes "e" after " d".
    llm = ScriptedLLM(["qu developer"])
    session = make_session(llm)
    message = await Harness(session, tools=[]).ask(stop=("e",))
    assert message["content"] == "qu d"
    assert TOK.decode(session.close().samples[0].response_ids) == "qu developer<|im_end|>"


async def test_calls_past_max_calls_are_refused():
    llm = ScriptedLLM([call_text("a")])
    session = make_session(llm, settings(max_calls=2))
    harness = Harness(session)
    await harness.step()
    await harness.step()
    with pytest.raises(MaxTurnsExceeded) as refused:
        await harness.step()
    assert refused.value.code == "max_turns_exceeded"
    outcome = session.close()
    assert outcome.max_calls_reached and outcome.counters.calls == 2
    assert_token_exact(outcome.samples[0], llm.calls)


@pytest.mark.parametrize("failure", ["unavailable", "abort"])
async def test_an_llm_failure_is_unavailable_and_recorded(failure):
    llm = ScriptedLLM([call_text("a")])
    session = make_session(llm)
    harness = Harness(session)
    await harness.step()
    if failure == "unavailable":
        llm.fail_with = Unreachable("all servers down")
    else:
        llm.finish_reason = "abort"
    with pytest.raises(Unavailable) as refused:
        await harness.step()
    assert refused.value.status == 503
    outcome = session.close()
    assert outcome.llm_unavailable
    assert len(outcome.samples) == 1 and len(outcome.samples[0].turns) == 1


async def test_the_policy_version_stamps_generations_whose_server_reports_none():
    llm = ScriptedLLM(["hi"], weight_version=None)
    session = make_session(llm)
    await Harness(session, tools=[]).ask()
    assert session.close().samples[0].turns[0].weight_version == 42


async def test_no_call_no_sample():
    outcome = make_session(ScriptedLLM(["x"])).close()
    assert outcome.samples == [] and outcome.counters.calls == 0


async def test_without_tools_the_reply_is_text_and_tool_markup_stays_in_it():
    llm = ScriptedLLM([call_text("ls")])
    session = make_session(llm)
    message = await Harness(session, tools=[]).ask()
    assert message == {"role": "assistant", "content": call_text("ls")}


async def test_completions_extend_by_ids_and_otherwise_start_a_new_sample():
    llm = ScriptedLLM(["one", "two", "three", "four"])
    session = make_session(llm)
    options = CallOptions()
    first = await session.complete("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", options)
    extended = first.prompt_ids + first.generation.output_ids + TOK.encode("\n<|im_start|>user\nmore<|im_end|>\n")
    await session.complete(extended, options)
    await session.complete(extended, options)  # the same prompt again: a retry
    await session.complete([1, 2, 3], options)  # unrelated: a new sample
    outcome = session.close()
    assert len(outcome.samples) == 2
    assert (outcome.counters.prefix_hits, outcome.counters.discarded, outcome.counters.splits) == (1, 1, 1)
    assert_token_exact(outcome.samples[0], [llm.calls[0], llm.calls[2]])
    assert_token_exact(outcome.samples[1], [llm.calls[3]])
