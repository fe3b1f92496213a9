"""Streaming through the gateway: content deltas as the tokens arrive, never text the final
content will not have (tool-call markup, stop strings, incomplete characters, whitespace a tool
call trims), the final result exactly as a whole call's, failures before and after the first
token, and a client that goes away mid-stream."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest

from corral.rollout.gateway import Gateway
from corral.rollout.gateway.render import Conversation, normalize_messages, normalize_tools
from corral.rollout.gateway.session import CallOptions
from corral.rollout.gateway.streaming import CallDone, ContentHoldback, IncrementalText, TextDelta
from corral.rollout.tool_calls import ToolCallFormat
from corral.rollout.types import DeltaSink, Generation, GenerationDelta, SamplingOptions
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
from tests.unit.test_gateway_render import tiny_qwen2  # noqa: F401 - a fixture

CALL = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
SUBMIT_BLOCK = "```bash\nls\n```"

# Replies whose streamed content must equal the whole call's: markup, stop strings ("STOP!" is
# the task's), broken markup that stays content, whitespace around calls, multibyte characters.
REPLIES = [
    "Plain answer, no calls.",
    "Looking.\n" + CALL,
    "Looking.  \n\n" + CALL + "\nAnd after.",
    "\n  Leading whitespace.\n" + CALL,
    "\n  Leading whitespace, no call.",
    "Text < tool and <tool_ and <tool_call",  # markup prefixes that never complete
    'Broken <tool_call>{"name": "bash"',
    "Stops here STOP! and not this",
    "Almost a stop STO but not",
    "Unicode: é, 日本, 🙂 done.",
    "Trailing spaces   ",
]


def chat(reply_tools: bool = True) -> tuple[Conversation, CallOptions]:
    tools = (normalize_tools([BASH_TOOL]) or ()) if reply_tools else ()
    conversation = Conversation(normalize_messages([{"role": "user", "content": "go"}]), tools)
    return conversation, CallOptions(parse_tool_calls=reply_tools)


async def streamed(session: Any, conversation: Conversation, options: CallOptions) -> tuple[list[str], CallDone]:
    texts: list[str] = []
    done = None
    async for event in session.chat_stream(conversation, options):
        if isinstance(event, TextDelta):
            assert event.text and done is None
            texts.append(event.text)
        else:
            done = event
    assert done is not None
    return texts, done


@pytest.mark.parametrize("reply", REPLIES)
@pytest.mark.parametrize("tools", [True, False], ids=["tools", "no-tools"])
async def test_streamed_chat_equals_the_whole_call_and_shows_only_final_content(reply, tools):
    whole_llm, stream_llm = ScriptedLLM([reply]), ScriptedLLM([reply])
    conversation, options = chat(tools)
    result, reply_message = await make_session(whole_llm).chat(conversation, options)
    texts, done = await streamed(make_session(stream_llm), conversation, options)
    assert "".join(texts) == reply_message["content"]
    assert done.reply is not None and done.result.generation == result.generation
    assert (done.result.text, done.result.tool_calls, done.result.finish_reason) == (
        result.text,
        result.tool_calls,
        result.finish_reason,
    )
    assert [c["function"] for c in done.reply.get("tool_calls", [])] == [
        c["function"] for c in reply_message.get("tool_calls", [])
    ]
    assert stream_llm.calls[0].prompt_ids == whole_llm.calls[0].prompt_ids


def feed_each(holdback: ContentHoldback, text: str) -> list[str]:
    """The text shown after each id of `text` (byte-tokenized, then <|im_end|>)."""
    shown = []
    for token in [*TOK.encode(text), IM_END_ID]:
        holdback.feed([token])
        shown.append(holdback.shown)
    return shown


def test_tool_call_markup_is_held_back_until_it_turns_out_not_to_be():
    holdback = ContentHoldback(TOK, frozenset({IM_END_ID}), ("STOP!",), ToolCallFormat.HERMES, 1000)
    shown = feed_each(holdback, "Look <tool_caX then " + CALL + " after")
    # "<tool_ca" was held while it could begin a call, and released when "X" showed it did not.
    assert "Look <tool_c" not in shown and "Look <tool_caX then" in shown
    # Nothing of the real call, nor the space before it, is ever shown; the text after it waits
    # for the end (the call may still turn out to be malformed, and then it is content).
    assert shown[-1] == "Look <tool_caX then"
    assert holdback.rest("Look <tool_caX then  after") == "  after"


def test_stop_strings_and_their_beginnings_are_held_back():
    holdback = ContentHoldback(TOK, frozenset({IM_END_ID}), ("STOP!", "\n\nUser:"), None, 1000)
    shown = feed_each(holdback, "a STOb STOP! c")
    assert "a STO" not in shown and "a STOb " in shown  # "STO" could have begun "STOP!"
    assert shown[-1] == "a STOb "  # the content ends where the stop string begins
    holdback = ContentHoldback(TOK, frozenset({IM_END_ID}), ("\n\nUser:",), None, 1000)
    assert feed_each(holdback, "x\n\nUse")[-1] == "x"


def test_fenced_bash_blocks_and_submit_lines_are_held_back():
    holdback = ContentHoldback(TOK, frozenset({IM_END_ID}), (), ToolCallFormat.FENCED_BASH, 1000)
    shown = feed_each(holdback, "Run it:\n" + SUBMIT_BLOCK + "\nSUBMIT")
    assert shown[-1] == "Run it:" and all("`" not in text for text in shown)
    holdback = ContentHoldback(TOK, frozenset({IM_END_ID}), (), ToolCallFormat.FENCED_BASH, 1000)
    shown = feed_each(holdback, "SUBMITTED it\nSUB\nSUBMIT\nafter")
    assert "SUBMITTED it" in shown and shown[-1] == "SUBMITTED it\nSUB"


def test_an_incomplete_character_and_ids_past_the_limit_are_not_shown():
    holdback = ContentHoldback(TOK, frozenset({IM_END_ID}), (), None, 4)
    first, second = TOK.encode("é")
    holdback.feed([first])
    assert holdback.shown == ""  # half a character
    holdback.feed([second])
    assert holdback.shown == "é"
    holdback.feed(TOK.encode("abcdef"))
    assert holdback.shown == "éab"  # 4 ids in all: the session cuts the reply there


async def test_deltas_come_as_the_tokens_arrive():
    """The first content arrives while the engine is still generating (the scripted LLM records
    its call only once it has sent every token)."""
    llm = ScriptedLLM(["A long reply, token after token, for a while."], token_delay_s=0.01)
    session = make_session(llm)
    conversation, options = chat(False)
    events = session.chat_stream(conversation, options)
    first = await anext(events)
    assert isinstance(first, TextDelta) and first.text == "A" and llm.calls == []
    rest = [event async for event in events]
    assert isinstance(rest[-1], CallDone) and len(llm.calls) == 1
    assert first.text + "".join(e.text for e in rest if isinstance(e, TextDelta)) == llm.replies[0]


async def test_a_generate_fn_that_cannot_stream_is_called_whole():
    llm = ScriptedLLM(["Whole."])

    async def whole_only(prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str) -> Generation:
        return await llm(prompt_ids, sampling, rollout_id)

    session = make_session(llm)
    session._generate, session._streams = whole_only, False
    texts, done = await streamed(session, *chat(False))
    assert texts == ["Whole."] and done.result.generation == llm.calls[0].generation


class FailsMidStream:
    """Streams `before` tokens of a reply, then fails as the pool does after a first token."""

    def __init__(self, before: int) -> None:
        self.before = before
        self.replies = ScriptedLLM(["Some words that never finish."])

    async def __call__(
        self, prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str, *, on_delta: DeltaSink | None = None
    ) -> Generation:
        ids = TOK.encode(self.replies.replies[0])[: self.before]
        for token in ids:
            assert on_delta is not None
            on_delta(GenerationDelta([token], [-0.5]))
            await asyncio.sleep(0)
        raise Unreachable("the server went away mid-stream")


async def sse_lines(url: str, body: dict, key: str) -> tuple[int, list[Any]]:
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http, http.post(url + "/chat/completions", json=body, headers=headers) as r:
        text = await r.text()
    if r.content_type != "text/event-stream":
        return r.status, [json.loads(text)]
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    return r.status, [event if event == "[DONE]" else json.loads(event) for event in events]


async def test_a_failure_before_the_first_token_gets_its_status_and_one_after_it_an_error_event():
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    for before, expected_status in ((0, 503), (5, 200)):
        gateway = Gateway(FailsMidStream(before), TOK, context_length=Window(4096))
        url = await gateway.listen_tcp()
        try:
            session = gateway.open_session(f"r-{before}", settings())
            status, events = await sse_lines(url, body, session.key)
            outcome = gateway.close_session(session.key)
        finally:
            await gateway.close()
        assert status == expected_status
        assert outcome.llm_unavailable and outcome.counters.calls == 0 and outcome.samples == []
        if before:
            contents = [e["choices"][0]["delta"].get("content") for e in events[:-2] if e.get("choices")]
            assert "".join(c or "" for c in contents) == "Some "  # the first five tokens
            assert events[-2]["error"]["code"] == "llm_unavailable" and events[-1] == "[DONE]"
        else:
            assert events[0]["error"]["code"] == "llm_unavailable"


async def test_a_client_that_goes_away_mid_stream_cancels_the_generation_and_records_nothing():
    reply = "x" * 400
    llm = ScriptedLLM([reply, "Short."], token_delay_s=0.01)
    gateway = Gateway(llm, TOK, context_length=Window(4096))
    url = await gateway.listen_tcp()
    try:
        session = gateway.open_session("r-gone", settings())
        headers = {"Authorization": f"Bearer {session.key}"}
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with aiohttp.ClientSession() as http:
            response = await http.post(url + "/chat/completions", json=body, headers=headers)
            seen = b""
            while b'"content":"x' not in seen:
                seen += await response.content.readany()
            response.close()  # the harness goes away after the first content
        for _ in range(200):  # the generation is cancelled (the lock frees for the next call)
            if not session.lock.locked():
                break
            await asyncio.sleep(0.01)
        assert not session.lock.locked() and llm.started == 1 and llm.calls == []
        assert session.counters.calls == 0
        # The rollout goes on: the next call is a first call, recorded exactly.
        client = openai.AsyncOpenAI(base_url=url, api_key=session.key)
        again = await client.chat.completions.create(model="m", messages=body["messages"])
        assert again.choices[0].message.content == "x" * 400
        outcome = gateway.close_session(session.key)
    finally:
        await gateway.close()
    assert outcome.llm_unavailable is None and outcome.counters.calls == 1
    (sample,) = outcome.samples
    assert_token_exact(sample, llm.calls)


async def test_openai_client_streams_chat_and_completions_with_logprobs_and_ids():
    llm = ScriptedLLM(["Looking.\n" + CALL, "Done STOP! not this"])
    gateway = Gateway(llm, TOK, context_length=Window(4096))
    url = await gateway.listen_tcp()
    try:
        session = gateway.open_session("r-sdk", settings())
        client = openai.AsyncOpenAI(base_url=url, api_key=session.key)
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "go"}],
            tools=[BASH_TOOL],
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        deltas = [c.choices[0] for c in chunks if c.choices]
        assert deltas[0].delta.role == "assistant"
        assert "".join(d.delta.content or "" for d in deltas) == "Looking."
        assert [e.logprob for d in deltas if d.logprobs for e in d.logprobs.content] == llm.calls[0].generation.logprobs
        (call,) = [call for d in deltas for call in d.delta.tool_calls or []]
        assert call.function.name == "bash" and deltas[-1].finish_reason == "tool_calls"
        assert chunks[-1].usage.completion_tokens == len(llm.calls[0].generation.output_ids)
        assert all(c.model_extra["corral"]["call_index"] == 0 for c in chunks)

        prompt = TOK.encode("<|im_start|>user\nnew<|im_end|>\n<|im_start|>assistant\n")
        completion = await client.completions.create(
            model="m", prompt=prompt, stream=True, logprobs=1, extra_body={"return_token_ids": True}
        )
        parts = [chunk async for chunk in completion]
        assert "".join(p.choices[0].text for p in parts) == "Done "
        assert [
            p.choices[0].model_extra.get("token_ids") for p in parts if p.choices[0].model_extra.get("token_ids")
        ] == [llm.calls[1].generation.output_ids]
        assert parts[-1].choices[0].finish_reason == "stop"
        assert all(p.model_extra["corral"]["call_index"] == 1 for p in parts)
    finally:
        await gateway.close()


async def test_concurrent_streamed_calls_of_one_session_carry_their_own_call_index():
    """Calls of one session wait for each other; each streamed call's chunks name the index its
    commit gives it, not the one current when it arrived."""
    llm = ScriptedLLM(["First reply.", "Second reply."], token_delay_s=0.005)
    gateway = Gateway(llm, TOK, context_length=Window(4096))
    url = await gateway.listen_tcp()
    try:
        session = gateway.open_session("r-two", settings())
        first = {"messages": [{"role": "user", "content": "one"}], "stream": True}
        second = {"messages": [{"role": "user", "content": "two"}], "stream": True}
        answers = await asyncio.gather(sse_lines(url, first, session.key), sse_lines(url, second, session.key))
    finally:
        await gateway.close()
    seen = {}
    for status, events in answers:
        chunks = [e for e in events if e != "[DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert status == 200 and len({c["corral"]["call_index"] for c in chunks}) == 1
        seen[text] = chunks[0]["corral"]["call_index"]
    assert seen == {"First reply.": 0, "Second reply.": 1}  # the replies come in commit order


@pytest.mark.parametrize("hf", [False, True], ids=["bytes", "hf"])
def test_incremental_decoding_is_the_tokenizers_decode_at_every_step(hf, request):
    """The holdback decodes only the end of a long reply; at every length its text is the
    tokenizer's own decode of all the ids (multibyte characters split across ids included)."""
    import random

    tokenizer = request.getfixturevalue("tiny_qwen2") if hf else TOK
    rng = random.Random(7)
    words = ["fix", " the", " test", "é", "日本", "🙂", "\n", "  ", "<tool_call>", "calc.py", "ü"]
    text = "".join(rng.choice(words) for _ in range(400))
    ids = tokenizer._tokenizer.encode(text) if hf else tokenizer.encode(text)
    decoded = IncrementalText(tokenizer)
    for end in range(1, len(ids) + 1):
        assert decoded.text(ids[:end]) == tokenizer.decode(ids[:end])
    assert decoded._settled > len(ids) // 2  # it did settle (decoding only the end)


async def test_weight_versions_reported_per_token_are_recorded_per_token():
    """A generation during which the weights changed (the engine labels each token): the sample
    keeps each generated token's version, and the turn the oldest."""
    reply = TOK.encode("Two versions.") + [IM_END_ID]
    versions = tuple([3] * 5 + [4] * (len(reply) - 5))

    async def relabelled(
        prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str, *, on_delta: DeltaSink | None = None
    ) -> Generation:
        if on_delta is not None:
            for token, version in zip(reply, versions):
                on_delta(GenerationDelta([token], [-0.5], version))
        return Generation(reply, [-0.5] * len(reply), "stop", 3, "labelled", weight_versions=versions)

    session = make_session(ScriptedLLM(["unused"]))
    session._generate = relabelled
    texts, done = await streamed(session, *chat(False))
    (sample,) = session.close().samples
    assert "".join(texts) == "Two versions." and done.result.generation.weight_versions == versions
    assert sample.weight_versions == list(versions) and sample.turns[0].weight_version == 3
