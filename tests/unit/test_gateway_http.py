"""The gateway over real HTTP: the `openai` package as the harness (chat with tools, streaming,
completions), keys and routes, OpenAI-shaped errors with definite statuses (never a 500), and an
end-to-end run through the reference server and the SGLang client."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from corral.rollout.gateway import Gateway, HistoryPolicy
from corral.rollout.llm.sglang import SGLangClient
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer
from corral.rollout.types import Generation, SamplingOptions
from corral.v1 import rollout_pb2 as pb
from tests.unit.gateway_support import (
    BASH_TOOL,
    TOK,
    LLMCall,
    ScriptedLLM,
    Unreachable,
    Window,
    assert_token_exact,
    post_json,
    settings,
)

TOOL_CALL = '<tool_call>{"name": "bash", "arguments": {"command": "ls -la"}}</tool_call>'


@pytest.fixture
async def served() -> AsyncIterator[tuple[Gateway, str, ScriptedLLM]]:
    llm = ScriptedLLM(["Looking.\n" + TOOL_CALL, "It works.\nDone."])
    gateway = Gateway(llm, TOK, model_name="tiny", context_length=Window(4096))
    url = await gateway.listen_tcp()
    yield gateway, url, llm
    await gateway.close()


async def test_openai_client_runs_a_tool_calling_conversation_and_streams_the_same_reply(served):
    gateway, url, llm = served
    session = gateway.open_session("r-openai", settings())
    client = openai.AsyncOpenAI(base_url=url, api_key=session.key)
    messages: list[Any] = [{"role": "user", "content": "List the files."}]
    first = await client.chat.completions.create(model="any", messages=messages, tools=[BASH_TOOL], logprobs=True)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Looking."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("bash", {"command": "ls -la"})
    assert [entry.logprob for entry in choice.logprobs.content] == llm.calls[0].generation.logprobs
    assert "".join(entry.token for entry in choice.logprobs.content) == TOK.decode(llm.calls[0].generation.output_ids)
    assert first.usage.prompt_tokens == len(llm.calls[0].prompt_ids)
    assert first.usage.completion_tokens == len(llm.calls[0].generation.output_ids)
    assert first.model_extra["corral"] == {"rollout_id": "r-openai", "call_index": 0}

    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "a.txt b.txt"})
    stream = await client.chat.completions.create(
        model="any", messages=messages, tools=[BASH_TOOL], stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == "It works.\nDone."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(llm.calls[1].generation.output_ids)

    outcome = gateway.close_session(session.key)
    assert outcome.counters.prefix_hits == 1 and len(outcome.samples) == 1
    assert_token_exact(outcome.samples[0], llm.calls)
    assert gateway.totals.calls == 2 and gateway.totals.prefix_hits == 1


async def test_streamed_tool_calls_parse_back_like_the_whole_response(served):
    gateway, url, llm = served
    whole_session = gateway.open_session("whole", settings())
    stream_session = gateway.open_session("stream", settings())
    messages = [{"role": "user", "content": "go"}]
    whole = await openai.AsyncOpenAI(base_url=url, api_key=whole_session.key).chat.completions.create(
        model="m", messages=messages, tools=[BASH_TOOL]
    )
    llm.calls.clear()
    stream = await openai.AsyncOpenAI(base_url=url, api_key=stream_session.key).chat.completions.create(
        model="m", messages=messages, tools=[BASH_TOOL], stream=True
    )
    deltas = [chunk.choices[0].delta async for chunk in stream]
    content = "".join(delta.content or "" for delta in deltas)
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert content == whole.choices[0].message.content
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]


async def test_malformed_tool_call_markup_comes_back_as_plain_content_and_the_sample_stays_exact():
    """With tools declared, a reply whose tool-call markup cannot be read (the real engine's noise
    model almost never writes markup, so this is covered here): plain content, the markup as the
    model wrote it, no tool_calls, finish "stop"; the harness sends it back and the session goes
    on extending one exact sample, the turn marked a format error."""
    malformed = 'Looking.\n<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>'
    llm = ScriptedLLM([malformed, "Done."])
    gateway = Gateway(llm, TOK, context_length=Window(4096))
    url = await gateway.listen_tcp()
    try:
        session = gateway.open_session("r-malformed", settings())
        client = openai.AsyncOpenAI(base_url=url, api_key=session.key)
        messages: list[Any] = [{"role": "user", "content": "List the files."}]
        first = await client.chat.completions.create(model="any", messages=messages, tools=[BASH_TOOL])
        choice = first.choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (malformed, None, "stop")
        messages += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": "Use the tool."}]
        second = await client.chat.completions.create(model="any", messages=messages, tools=[BASH_TOOL])
        assert second.choices[0].message.content == "Done."
        outcome = gateway.close_session(session.key)
    finally:
        await gateway.close()
    assert (outcome.counters.calls, outcome.counters.prefix_hits, outcome.counters.splits) == (2, 1, 0)
    (sample,) = outcome.samples
    assert_token_exact(sample, llm.calls)
    assert [turn.format_error for turn in sample.turns] == [True, False]


async def test_completions_whole_and_streamed_give_the_same_text_and_ids(served):
    gateway, url, llm = served
    session = gateway.open_session("r-completions", settings())
    client = openai.AsyncOpenAI(base_url=url, api_key=session.key)
    prompt = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    whole = await client.completions.create(model="m", prompt=prompt, logprobs=1, extra_body={"return_token_ids": True})
    assert whole.choices[0].text == "Looking.\n" + TOOL_CALL
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].logprobs.token_logprobs == llm.calls[0].generation.logprobs
    assert whole.model_extra["prompt_token_ids"] == TOK.encode(prompt)
    token_ids = whole.choices[0].model_extra["token_ids"]
    assert token_ids == llm.calls[0].generation.output_ids
    # The next prompt is sent as ids that extend the first call's: one sample.
    next_prompt = whole.model_extra["prompt_token_ids"] + token_ids + TOK.encode("\n<|im_start|>user\nok<|im_end|>\n")
    stream = await client.completions.create(
        model="m", prompt=next_prompt, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == "It works.\nDone."
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == len(next_prompt)
    outcome = gateway.close_session(session.key)
    assert outcome.counters.prefix_hits == 1 and len(outcome.samples) == 1
    assert_token_exact(outcome.samples[0], llm.calls)


async def test_keys_in_the_path_and_unknown_or_closed_keys(served):
    gateway, url, _ = served
    session = gateway.open_session("r-keys", settings())
    base = url.removesuffix("/v1")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    status, data = await post_json(base, f"/r/{session.key}/v1/chat/completions", body, None)
    assert status == 200 and data["choices"][0]["message"]["role"] == "assistant"
    async with aiohttp.ClientSession() as http, http.get(f"{base}/r/{session.key}/v1/models") as response:
        models = await response.json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 4096
    for key in ("not-a-key", None):
        status, data = await post_json(url, "/chat/completions", body, key)
        assert status == 401 and data["error"]["code"] == "invalid_api_key"
    gateway.close_session(session.key)
    status, data = await post_json(url, "/chat/completions", body, session.key)
    assert status == 401
    status, _ = await post_json(base, f"/r/{session.key}/v1/completions", {"prompt": "x"}, None)
    assert status == 401
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=url, api_key=session.key).models.list()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        ("/chat/completions", {"model": "m"}, "messages"),
        ("/chat/completions", {"messages": "hello"}, "messages"),
        ("/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
        ("/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, "max_tokens"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "x"}]}, "tools[0]"),
        (
            "/chat/completions",
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
                ]
            },
            "messages[0].tool_calls",
        ),
        ("/chat/completions", [1, 2], None),
        ("/chat/completions", b"{not json", None),
        ("/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/completions", {"prompt": [1, -2]}, "prompt"),
        ("/completions", {}, "prompt"),
        ("/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ],
)
async def test_bad_requests_get_400_with_the_reason(served, path, body, param):
    gateway, url, llm = served
    session = gateway.open_session("r-bad", settings())
    status, data = await post_json(url, path, body, session.key)
    assert status == 400, data
    assert data["error"]["type"] == "invalid_request_error" and data["error"]["message"]
    assert data["error"]["param"] == param
    assert llm.calls == []


async def test_refusals_carry_their_status_and_code(served):
    gateway, url, llm = served
    body = {"messages": [{"role": "user", "content": "hi"}]}
    # Context: a prompt longer than the window.
    small = gateway.open_session("r-small", settings(max_total_tokens=10))
    status, data = await post_json(url, "/chat/completions", body, small.key)
    assert (status, data["error"]["code"]) == (400, "context_length_exceeded")
    assert gateway.close_session(small.key).context_full
    # Max calls.
    once = gateway.open_session("r-once", settings(max_calls=1))
    assert (await post_json(url, "/chat/completions", body, once.key))[0] == 200
    status, data = await post_json(
        url, "/chat/completions", body | {"messages": [{"role": "user", "content": "x"}]}, once.key
    )
    assert (status, data["error"]["code"]) == (400, "max_turns_exceeded")
    # History rewritten under FAIL.
    strict = gateway.open_session("r-strict", settings(HistoryPolicy.FAIL))
    assert (await post_json(url, "/chat/completions", body, strict.key))[0] == 200
    status, data = await post_json(
        url, "/chat/completions", {"messages": [{"role": "user", "content": "other"}]}, strict.key
    )
    assert (status, data["error"]["code"]) == (409, "history_rewritten")
    assert gateway.close_session(strict.key).history_rewritten
    # No LLM.
    down = gateway.open_session("r-down", settings())
    llm.fail_with = Unreachable("every server is down")
    status, data = await post_json(url, "/chat/completions", body, down.key)
    assert (status, data["error"]["code"]) == (503, "llm_unavailable")
    assert "every server is down" in gateway.close_session(down.key).llm_unavailable


async def test_calls_of_one_session_are_assembled_in_order_while_sessions_run_concurrently():
    gate = asyncio.Event()
    started: list[str] = []

    async def generate(prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str) -> Generation:
        started.append(rollout_id)
        await gate.wait()
        ids = TOK.encode("ok") + [TOK.end_of_turn_ids[0]]
        return Generation(ids, [0.0] * len(ids), "stop")

    gateway = Gateway(generate, TOK)
    url = await gateway.listen_tcp()
    try:
        a, b = gateway.open_session("a", settings()), gateway.open_session("b", settings())
        body = {"messages": [{"role": "user", "content": "hi"}]}
        calls = [asyncio.create_task(post_json(url, "/chat/completions", body, key)) for key in (a.key, a.key, b.key)]
        while len(started) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert sorted(started) == ["a", "b"]  # a's second call waits for its first
        gate.set()
        results = await asyncio.gather(*calls)
        assert [status for status, _ in results] == [200, 200, 200]
        assert sorted(r["corral"]["call_index"] for _, r in results[:2]) == [0, 1]
    finally:
        await gateway.close()


async def test_unix_socket_and_bound_socket_listeners(tmp_path):
    llm = ScriptedLLM(["hi"])
    gateway = Gateway(llm, TOK)
    path = str(tmp_path / "gw.sock")
    await gateway.listen_unix(path)
    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))
    bound.listen()
    await gateway.listen_socket(bound)
    try:
        session = gateway.open_session("r-sockets", settings())
        body = {"messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {session.key}"}
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as http:
            async with http.post("http://gateway/v1/chat/completions", json=body, headers=headers) as response:
                assert response.status == 200
                assert (await response.json())["choices"][0]["message"]["content"] == "hi"
        port = bound.getsockname()[1]
        status, data = await post_json(f"http://127.0.0.1:{port}/v1", "/chat/completions", body, session.key)
        assert status == 200 and data["corral"]["call_index"] == 1
    finally:
        await gateway.close()


def replay_task() -> pb.Task:
    task = pb.Task(task_id="t1", tool_call_format=pb.TOOL_CALL_FORMAT_HERMES)
    task.prompt.messages.add(role="system", content="You are an agent.")
    task.prompt.messages.add(role="user", content="Make the tests pass in the calc repository.")
    for command in ("ls", "python3 -m unittest", "sed -i s/-/+/ calc.py", "python3 -m unittest"):
        task.reference_solution.add(name="bash", arguments_json=json.dumps({"command": command}))
    return task


async def test_end_to_end_through_the_reference_server_and_the_sglang_client():
    """A harness drives five calls through the gateway to the replay policy served over SGLang's
    protocol: the sample is exactly the ids the server got and returned."""
    server = ReferenceServer(ReplayPolicy([replay_task()]))
    server_url = await server.start()
    client = SGLangClient(server_url)
    calls: list[LLMCall] = []

    async def generate(prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str) -> Generation:
        generation = await client.generate(prompt_ids, sampling)
        calls.append(
            LLMCall(list(prompt_ids), generation, sampling.max_new_tokens, sampling.stop, sampling.stop_token_ids)
        )
        return generation

    gateway = Gateway(generate, TOK)
    url = await gateway.listen_tcp()
    try:
        session = gateway.open_session("r-e2e", settings())
        harness = openai.AsyncOpenAI(base_url=url, api_key=session.key)
        task = replay_task()
        messages: list[Any] = [{"role": m.role, "content": m.content} for m in task.prompt.messages]
        commands = []
        for _ in range(5):
            reply = await harness.chat.completions.create(model="m", messages=messages, tools=[BASH_TOOL])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            call = message.tool_calls[0]
            commands.append((call.function.name, json.loads(call.function.arguments)))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"ran {call.function.name}"})
        expected = [(c.name, json.loads(c.arguments_json)) for c in task.reference_solution]
        assert commands == [*expected, ("submit", {})]
        outcome = gateway.close_session(session.key)
        assert (outcome.counters.calls, outcome.counters.prefix_hits, outcome.counters.splits) == (5, 4, 0)
        assert_token_exact(outcome.samples[0], calls)
        assert server.requests_served == 5
    finally:
        await gateway.close()
        await client.close()
        await server.stop()


async def test_a_call_in_flight_when_its_session_closes_is_refused_and_recorded_nowhere():
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def generate(prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str) -> Generation:
        entered.set()
        await gate.wait()
        ids = TOK.encode("late") + [TOK.end_of_turn_ids[0]]
        return Generation(ids, [0.0] * len(ids), "stop")

    gateway = Gateway(generate, TOK)
    url = await gateway.listen_tcp()
    try:
        session = gateway.open_session("r-late", settings())
        body = {"messages": [{"role": "user", "content": "hi"}]}
        call = asyncio.create_task(post_json(url, "/chat/completions", body, session.key))
        await entered.wait()
        waiting = asyncio.create_task(post_json(url, "/completions", {"prompt": "x"}, session.key))
        await asyncio.sleep(0.05)  # queued behind the first call
        outcome = gateway.close_session(session.key)
        gate.set()
        for status, data in await asyncio.gather(call, waiting):
            assert (status, data["error"]["code"]) == (401, "invalid_api_key")
        assert outcome.samples == [] and outcome.counters.calls == 0
        with pytest.raises(KeyError):
            gateway.close_session(session.key)
    finally:
        await gateway.close()
