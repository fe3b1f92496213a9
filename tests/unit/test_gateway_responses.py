"""The gateway's OpenAI Responses API over real HTTP, with the `openai` package's Responses client
as the harness: whole and streamed replies (the SSE events as OpenAI sends them), a multi-call
conversation with function and custom (freeform) tool calls that stays one token-exact sample,
call ids kept end to end, requests in the shapes Codex CLI sends, and refusals in OpenAI's error
shape, never a 5xx (with a small fuzz of malformed bodies)."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from corral.rollout.gateway import Gateway
from tests.unit.gateway_support import TOK, ScriptedLLM, Window, assert_token_exact, post_json, settings

SHELL_TOOL = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edits files. This is a FREEFORM tool.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" LF'},
}
PATCH = "*** Begin Patch\n*** Update File: a.py\n@@\n-x = 1\n+x = 2\n*** End Patch"


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


REPLIES = [
    "Looking.\n" + hermes("exec_command", {"cmd": "ls"}),
    hermes("apply_patch", {"input": PATCH}),
    "Fixed it.",
]


@pytest.fixture
async def served() -> AsyncIterator[tuple[Gateway, str, ScriptedLLM]]:
    llm = ScriptedLLM(list(REPLIES))
    gateway = Gateway(llm, TOK, model_name="tiny", context_length=Window(8192))
    url = await gateway.listen_tcp()
    yield gateway, url, llm
    await gateway.close()


async def _post(url: str, body: Any, key: str | None, path: str = "/responses") -> tuple[int, Any]:
    return await post_json(url, path, body, key)


async def test_a_conversation_with_function_and_custom_tool_calls_is_one_token_exact_sample(served):
    """Codex's loop: the full history is sent back on every call (store false, no
    previous_response_id), the reply's items as they were returned, the tool outputs by call_id."""
    gateway, url, llm = served
    session = gateway.open_session("r-responses", settings())
    client = openai.AsyncOpenAI(base_url=url, api_key=session.key)
    items: list[Any] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix a.py"}]},
    ]
    common: dict[str, Any] = {
        "model": "any",
        "instructions": "You are a coding agent.",
        "tools": [SHELL_TOOL, PATCH_TOOL],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "store": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "text": {"verbosity": "low"},
        "prompt_cache_key": "thread-1",
        "extra_body": {"client_metadata": {"session_id": "thread-1"}},
    }

    first = await client.responses.create(input=items, **common)
    assert first.status == "completed"
    message, call = first.output
    assert message.type == "message" and message.content[0].text == "Looking."
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "exec_command", {"cmd": "ls"})
    assert call.call_id.startswith("call_")
    assert first.usage.input_tokens == len(llm.calls[0].prompt_ids)
    assert first.usage.output_tokens == len(llm.calls[0].generation.output_ids)
    assert first.model_extra["corral"] == {"rollout_id": "r-responses", "call_index": 0}

    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "a.py"})
    second = await client.responses.create(input=items, **common)
    (patch,) = second.output
    assert (patch.type, patch.name, patch.input) == ("custom_tool_call", "apply_patch", PATCH)

    items.append(patch.model_dump(exclude_none=True))
    items.append({"type": "custom_tool_call_output", "call_id": patch.call_id, "output": "Success."})
    third = await client.responses.create(input=items, **common)
    assert third.output_text == "Fixed it."

    outcome = gateway.close_session(session.key)
    counters = outcome.counters
    assert (counters.calls, counters.prefix_hits, counters.splices, counters.splits) == (3, 2, 0, 0)
    (sample,) = outcome.samples
    assert_token_exact(sample, llm.calls)
    # The custom tool was shown to the model as a function with one string argument, its grammar said.
    prompt = TOK.decode(llm.calls[0].prompt_ids)
    assert '"name": "apply_patch"' in prompt and "lark grammar" in prompt
    assert prompt.startswith("<|im_start|>system\nYou are a coding agent.")


async def test_call_ids_are_compared_when_the_history_comes_back(served):
    """A harness that sends the reply back with another call_id is not extending it: a new sample."""
    gateway, url, _ = served
    session = gateway.open_session("r-ids", settings())
    client = openai.AsyncOpenAI(base_url=url, api_key=session.key)
    items: list[Any] = [{"role": "user", "content": "Fix a.py"}]
    first = await client.responses.create(model="m", input=items, tools=[SHELL_TOOL])
    returned = [item.model_dump(exclude_none=True) for item in first.output]
    returned[1]["call_id"] = "call_someone_else"
    items += [*returned, {"type": "function_call_output", "call_id": "call_someone_else", "output": "a.py"}]
    await client.responses.create(model="m", input=items, tools=[SHELL_TOOL])
    outcome = gateway.close_session(session.key)
    assert (outcome.counters.prefix_hits, outcome.counters.splits, len(outcome.samples)) == (0, 1, 2)


async def test_parallel_calls_come_back_as_one_assistant_turn():
    """Two calls in one reply are two function_call items; sent back with their outputs after
    them, they are the one assistant message the gateway returned (a prefix hit)."""
    two = hermes("exec_command", {"cmd": "ls"}) + "\n" + hermes("exec_command", {"cmd": "pwd"})
    llm = ScriptedLLM([two, "Done."])
    gateway = Gateway(llm, TOK, context_length=Window(8192))
    url = await gateway.listen_tcp()
    try:
        session = gateway.open_session("parallel", settings())
        client = openai.AsyncOpenAI(base_url=url, api_key=session.key)
        items: list[Any] = [{"role": "user", "content": "Look around."}]
        first = await client.responses.create(model="m", input=items, tools=[SHELL_TOOL], parallel_tool_calls=True)
        assert [(item.type, json.loads(item.arguments)) for item in first.output] == [
            ("function_call", {"cmd": "ls"}),
            ("function_call", {"cmd": "pwd"}),
        ]
        items += [item.model_dump(exclude_none=True) for item in first.output]
        items += [{"type": "function_call_output", "call_id": item.call_id, "output": "x"} for item in first.output]
        await client.responses.create(model="m", input=items, tools=[SHELL_TOOL])
        outcome = gateway.close_session(session.key)
    finally:
        await gateway.close()
    assert (outcome.counters.prefix_hits, outcome.counters.splits) == (1, 0)
    assert_token_exact(outcome.samples[0], llm.calls)


async def test_streamed_events_carry_the_same_reply_as_the_whole_response(served):
    gateway, url, llm = served
    whole_key = gateway.open_session("whole", settings()).key
    stream_key = gateway.open_session("stream", settings()).key
    request: dict[str, Any] = {
        "model": "m",
        "input": "Fix a.py",
        "tools": [SHELL_TOOL, PATCH_TOOL],
        "include": ["message.output_text.logprobs"],
    }
    whole = await openai.AsyncOpenAI(base_url=url, api_key=whole_key).responses.create(**request)
    llm.calls.clear()
    stream = await openai.AsyncOpenAI(base_url=url, api_key=stream_key).responses.create(stream=True, **request)
    events = [event async for event in stream]
    types = [event.type for event in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert [item.type for item in done.output] == [item.type for item in whole.output]
    assert done.output[0].content[0].text == whole.output[0].content[0].text == "Looking."
    assert done.output[1].arguments == whole.output[1].arguments
    delta = next(event for event in events if event.type == "response.output_text.delta")
    assert [entry.logprob for entry in delta.logprobs] == llm.calls[0].generation.logprobs
    assert [entry.logprob for entry in whole.output[0].content[0].logprobs] == [
        entry.logprob for entry in delta.logprobs
    ]


async def test_the_raw_event_stream_names_each_event(served):
    gateway, url, _ = served
    key = gateway.open_session("raw", settings()).key
    body = {"model": "m", "input": "hi", "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http, http.post(url + "/responses", json=body, headers=headers) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        frames = (await response.text()).strip().split("\n\n")
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == event_line.removeprefix("event: ")
    assert "[DONE]" not in frames[-1]


async def test_a_reply_cut_at_max_output_tokens_is_incomplete(served):
    gateway, url, llm = served
    session = gateway.open_session("cut", settings())
    client = openai.AsyncOpenAI(base_url=url, api_key=session.key)
    whole = await client.responses.create(model="m", input="hi", max_output_tokens=4)
    assert llm.calls[-1].max_new_tokens == 4
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete" and whole.output_text == "Look"
    stream = await client.responses.create(model="m", input="hi", max_output_tokens=4, stream=True)
    assert [event.type async for event in stream][-1] == "response.incomplete"


async def test_keys_in_the_path_and_the_bearer_header(served):
    gateway, url, _ = served
    session = gateway.open_session("keys", settings())
    root = url.removesuffix("/v1")
    status, body = await _post(f"{root}/r/{session.key}/v1", {"model": "m", "input": "hi"}, None)
    assert status == 200 and body["object"] == "response"
    status, body = await _post(url, {"model": "m", "input": "hi"}, "not-a-key")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"model": "m", "input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"model": "m", "input": "hi", "background": True}, "background"),
        ({"model": "m", "input": "hi", "truncation": "auto"}, "truncation"),
        ({"model": "m", "input": "hi", "frequency": 1}, "frequency"),
        ({"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"model": "m", "input": "hi", "tools": [{"type": "namespace", "name": "x", "tools": []}]}, "tools[0].type"),
        ({"model": "m", "input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"model": "m", "input": "hi", "reasoning": {"encrypted": True}}, "reasoning.encrypted"),
        ({"model": "m", "input": "hi", "include": ["everything"]}, "include"),
        ({"model": "m", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m", "input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"model": "m", "input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "input[0]"),
        ({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"model": "m", "input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input[0].arguments",
        ),
        ({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m"}, "input"),
    ],
)
async def test_refusals_are_400_in_openai_shape_naming_the_field(served, body, param):
    gateway, url, llm = served
    session = gateway.open_session("bad", settings())
    status, answer = await _post(url, body, session.key)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param
    assert llm.calls == []


async def test_a_small_fuzz_of_malformed_bodies_never_gets_a_5xx(served):
    """Random mutations of a valid Codex-shaped body (fields dropped, retyped, nested wrongly) and
    random bytes: every answer is 200 or a 4xx in OpenAI's shape."""
    gateway, url, _ = served
    rng = random.Random(30)
    valid: dict[str, Any] = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
            {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": PATCH},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"},
        ],
        "tools": [SHELL_TOOL, PATCH_TOOL],
        "tool_choice": "auto",
        "reasoning": {"effort": "low"},
        "include": ["reasoning.encrypted_content"],
        "text": {"verbosity": "low"},
        "stream": False,
    }
    junk: list[Any] = [None, 0, -1, 1.5, True, "", "x", [], {}, [None], {"type": None}, [{"type": "input_text"}]]

    def mutate(value: Any, depth: int = 0) -> Any:
        if isinstance(value, dict) and value and rng.random() < 0.8:
            value = dict(value)
            key = rng.choice(sorted(value))
            choice = rng.random()
            if choice < 0.3:
                del value[key]
            elif choice < 0.6 or depth > 3:
                value[key] = rng.choice(junk)
            else:
                value[key] = mutate(value[key], depth + 1)
            return value
        if isinstance(value, list) and value and rng.random() < 0.8:
            value = list(value)
            index = rng.randrange(len(value))
            value[index] = mutate(value[index], depth + 1) if rng.random() < 0.7 else rng.choice(junk)
            return value
        return rng.choice(junk)

    bodies: list[Any] = [mutate(valid) for _ in range(300)]
    bodies += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(20)]
    bodies += [json.dumps(valid)[: rng.randrange(1, 200)] for _ in range(20)]
    statuses: dict[int, int] = {}
    for body in bodies:
        key = gateway.open_session("fuzz", settings()).key
        status, answer = await _post(url, body, key)
        statuses[status] = statuses.get(status, 0) + 1
        assert status == 200 or (400 <= status < 500 and set(answer["error"]) >= {"message", "type", "param"}), (
            body,
            answer,
        )
    assert len(bodies) == 340 and statuses.get(400, 0) > 200, statuses
