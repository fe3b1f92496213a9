"""Anthropic's Messages API on the gateway, over real HTTP: a tool-calling conversation as Claude
Code sends it (system blocks, mid-conversation system turns, cache_control, thinking) that stays
one token-exact sample, whole and streamed replies, the tool_use ids kept end to end, stop
reasons, count_tokens, keys, and errors in Anthropic's shape with definite statuses (a fuzz of
malformed bodies included: never a 5xx)."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from corral.rollout.gateway import Gateway, HistoryPolicy
from corral.rollout.gateway.anthropic_api import parse_messages_request
from corral.rollout.gateway.errors import RequestError
from corral.rollout.gateway.render import ChatRenderer
from tests.unit.gateway_support import TOK, ScriptedLLM, Unreachable, Window, assert_token_exact, settings

EDIT = '<tool_call>{"name": "Edit", "arguments": {"file_path": "/w/a.py", "old_string": "a - b", "new_string": "a + b"}}</tool_call>'
BASH = '<tool_call>{"name": "Bash", "arguments": {"command": "python3 -m unittest"}}</tool_call>'
TOOLS = [
    {
        "name": "Edit",
        "description": "Edit a file.",
        "input_schema": {
            "type": "object",
            "properties": {
                "file_path": {"type": "string"},
                "old_string": {"type": "string"},
                "new_string": {"type": "string"},
            },
        },
        "cache_control": {"type": "ephemeral"},
    },
    {"name": "Bash", "description": "Run a command.", "input_schema": {"type": "object"}},
    {
        "name": "Deferred",
        "description": "Loaded by a tool search.",
        "input_schema": {"type": "object"},
        "defer_loading": True,
    },
]
BILLING = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli;"}


def first_request(**extra: Any) -> dict[str, Any]:
    """A first call shaped as Claude Code's (system blocks, a system turn after the task)."""
    return {
        "model": "claude-opus-5-5",
        "max_tokens": 32000,
        "stream": False,
        "system": [
            BILLING,
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>r</system-reminder>\n"},
                    {"type": "text", "text": "Fix calc.py."},
                ],
            },
            {
                "role": "system",
                "content": [{"type": "text", "text": "# Environment\ncwd: /w", "cache_control": {"type": "ephemeral"}}],
            },
        ],
        "tools": TOOLS,
        "metadata": {"user_id": "u"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        **extra,
    }


@pytest.fixture
async def served() -> AsyncIterator[tuple[Gateway, str, ScriptedLLM]]:
    llm = ScriptedLLM(["Let me fix it.\n" + EDIT, BASH, "Fixed: the tests pass."])
    gateway = Gateway(llm, TOK, model_name="tiny", context_length=Window(1 << 16))
    url = (await gateway.listen_tcp()).removesuffix("/v1")
    yield gateway, url, llm
    await gateway.close()


async def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any, str]:
    """(status, JSON body or the SSE events as [(event, data)], content type)."""
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with aiohttp.ClientSession() as http, http.post(url + path, data=data, headers=headers or {}) as response:
        text = await response.text()
        if response.content_type == "text/event-stream":
            return response.status, parse_sse(text), response.content_type
        return response.status, json.loads(text), response.content_type


def parse_sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for frame in text.split("\n\n"):
        if frame:
            event_line, data_line = frame.split("\n")
            assert event_line.startswith("event: ") and data_line.startswith("data: ")
            data = json.loads(data_line.removeprefix("data: "))
            assert data["type"] == event_line.removeprefix("event: ")
            events.append((data["type"], data))
    return events


def message_from_events(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The Message a streaming client assembles from the events (as Anthropic's SDKs do)."""
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    message = copy.deepcopy(events[0][1]["message"])
    partial: dict[int, str] = {}
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(copy.deepcopy(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                assert delta["type"] == "input_json_delta"
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        else:
            assert name == "content_block_stop"
            if data["index"] in partial:
                message["content"][data["index"]]["input"] = json.loads(partial[data["index"]])
    delta = events[-2][1]
    message.update(delta["delta"])
    message["usage"]["output_tokens"] = delta["usage"]["output_tokens"]
    return message


async def test_a_claude_code_shaped_conversation_is_one_token_exact_sample_with_ids_kept(served):
    gateway, url, llm = served
    session = gateway.open_session("r-anthropic", settings())
    headers = {"x-api-key": session.key, "anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}
    request = first_request()
    status, first, _ = await post(url, "/v1/messages?beta=true", request, headers)
    assert status == 200, first
    assert (first["type"], first["role"], first["stop_reason"], first["stop_sequence"]) == (
        "message",
        "assistant",
        "tool_use",
        None,
    )
    text, tool_use = first["content"]
    assert text == {"type": "text", "text": "Let me fix it."}
    assert tool_use["type"] == "tool_use" and tool_use["id"].startswith("call_")
    assert (tool_use["name"], tool_use["input"]) == (
        "Edit",
        {"file_path": "/w/a.py", "old_string": "a - b", "new_string": "a + b"},
    )
    assert first["usage"]["input_tokens"] == len(llm.calls[0].prompt_ids)
    assert first["usage"]["output_tokens"] == len(llm.calls[0].generation.output_ids)
    assert first["corral"] == {"rollout_id": "r-anthropic", "call_index": 0}
    # What the model saw: the system blocks without the billing header, the system turn, the
    # tools but the deferred one.
    prompt = TOK.decode(llm.calls[0].prompt_ids)
    assert "x-anthropic-billing-header" not in prompt and "You are a coding agent." in prompt
    assert "# Environment\ncwd: /w" in prompt and '"name": "Edit"' in prompt and "Deferred" not in prompt

    # Streamed, as Claude Code asks: the reply comes back with a thinking block the gateway
    # never sent (dropped) and the system turn as a string this time.
    request["messages"][1]["content"] = "# Environment\ncwd: /w"
    request["messages"] += [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, *first["content"]]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": tool_use["id"],
                    "content": "Edited.",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ]
    request["stream"] = True
    status, events, content_type = await post(url, "/v1/messages", request, headers)
    assert (status, content_type) == (200, "text/event-stream"), events
    second = message_from_events(events)
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    (bash,) = second["content"]
    assert (bash["name"], bash["input"], second["stop_reason"]) == (
        "Bash",
        {"command": "python3 -m unittest"},
        "tool_use",
    )
    assert second["corral"]["call_index"] == 1

    # Whole again, the tool result as text blocks and marked an error; the final reply is text.
    request["messages"] += [
        {"role": "assistant", "content": second["content"]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": bash["id"], "content": [{"type": "text", "text": "OK"}], "is_error": False},
            {"type": "text", "text": "<system-reminder>keep going</system-reminder>"},
        ]},
    ]  # fmt: skip
    request["stream"] = False
    status, third, _ = await post(url, "/v1/messages", request, {"Authorization": f"Bearer {session.key}"})
    assert status == 200, third
    assert (
        third["content"] == [{"type": "text", "text": "Fixed: the tests pass."}] and third["stop_reason"] == "end_turn"
    )

    outcome = gateway.close_session(session.key)
    (sample,) = outcome.samples
    assert_token_exact(sample, llm.calls)
    counters = outcome.counters
    assert (counters.calls, counters.prefix_hits, counters.splices, counters.splits) == (3, 2, 0, 0)


async def test_the_streamed_reply_is_the_whole_reply(served):
    gateway, url, llm = served
    whole_session, streamed_session = gateway.open_session("w", settings()), gateway.open_session("s", settings())
    _, whole, _ = await post(url, "/v1/messages", first_request(), {"x-api-key": whole_session.key})
    llm.calls.clear()
    _, events, _ = await post(url, "/v1/messages", first_request(stream=True), {"x-api-key": streamed_session.key})
    streamed = message_from_events(events)
    assert (whole.pop("corral")["rollout_id"], streamed.pop("corral")["rollout_id"]) == ("w", "s")
    for message in (whole, streamed):
        message.pop("id")
        for block in message["content"]:
            block.pop("id", None)
    assert streamed == whole
    start = events[0][1]["message"]
    assert start["stop_reason"] is None and start["usage"]["output_tokens"] == 0


async def test_a_tool_use_sent_back_with_another_id_does_not_extend_the_sample(served):
    gateway, url, llm = served
    session = gateway.open_session("ids", settings())
    headers = {"x-api-key": session.key}
    request = first_request()
    _, first, _ = await post(url, "/v1/messages", request, headers)
    forged = [dict(block, id="toolu_other") if block["type"] == "tool_use" else block for block in first["content"]]
    request["messages"] += [
        {"role": "assistant", "content": forged},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_other", "content": "ok"}]},
    ]
    assert (await post(url, "/v1/messages", request, headers))[0] == 200
    outcome = gateway.close_session(session.key)
    assert (outcome.counters.prefix_hits, outcome.counters.splits, len(outcome.samples)) == (0, 1, 2)


async def test_stop_reasons_max_tokens_and_stop_sequence(served):
    gateway, url, llm = served
    llm.replies = ["Fixed it. DONE and more"]
    session = gateway.open_session("stops", settings())
    headers = {"x-api-key": session.key}
    request = first_request(tools=None, max_tokens=3)
    del request["tools"]
    _, short, _ = await post(url, "/v1/messages", request, headers)
    assert (short["stop_reason"], short["content"], short["usage"]["output_tokens"]) == (
        "max_tokens", [{"type": "text", "text": "Fix"}], 3,
    )  # fmt: skip
    request.update(max_tokens=100, stop_sequences=["DONE"])
    _, stopped, _ = await post(url, "/v1/messages", request, headers)
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "DONE")
    assert stopped["content"] == [{"type": "text", "text": "Fixed it. "}]
    assert llm.calls[-1].stop == ("STOP!", "DONE")  # the task's stops, then the request's


async def test_count_tokens_is_the_full_rendering_and_no_call(served):
    gateway, url, llm = served
    session = gateway.open_session("count", settings())
    request = first_request()
    del request["max_tokens"]
    status, counted, _ = await post(url, "/v1/messages/count_tokens", request, {"x-api-key": session.key})
    assert status == 200 and session.counters.calls == 0 and llm.calls == []
    await post(url, "/v1/messages", first_request(), {"x-api-key": session.key})
    assert counted == {"input_tokens": len(llm.calls[0].prompt_ids)}


async def test_keys_from_the_path_x_api_key_or_bearer_and_unknown_keys_in_anthropic_shape(served):
    gateway, url, _ = served
    session = gateway.open_session("keys", settings())
    assert (await post(url, f"/r/{session.key}/v1/messages", first_request()))[0] == 200
    status, body, _ = await post(url, "/v1/messages", first_request(), {"x-api-key": "nope"})
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert "invalid_api_key" in body["error"]["message"]
    gateway.close_session(session.key)
    assert (await post(url, "/v1/messages", first_request(), {"Authorization": f"Bearer {session.key}"}))[0] == 401


def without(name: str) -> dict[str, Any]:
    request = first_request()
    del request[name]
    return request


def with_message(content: Any, role: str = "user") -> dict[str, Any]:
    request = first_request()
    request["messages"].append({"role": role, "content": content})
    return request


BAD_REQUESTS = [
    (without("max_tokens"), "max_tokens", "'max_tokens' is required"),
    (first_request(max_tokens=0), "max_tokens", "positive integer"),
    (first_request(n=2), "n", "unknown or unsupported field 'n'"),
    (first_request(container="c"), "container", "unknown or unsupported field"),
    (first_request(mcp_servers=[]), "mcp_servers", "unknown or unsupported field"),
    (first_request(output_config={"format": {"type": "json_schema"}}), "output_config.format", "not supported"),
    (
        first_request(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}),
        "context_management.edits[0].type",
        "only clearing thinking",
    ),
    (
        first_request(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "tools[0].type",
        "server and built-in tools are not supported",
    ),
    (first_request(tools=[{"name": "x", "input_schema": {}, "input_examples": []}]), "tools[0].input_examples", ""),
    (first_request(tool_choice={"type": "tool", "name": "Nope"}), "tool_choice.name", "names no declared tool"),
    (first_request(stop_sequences="DONE"), "stop_sequences", "array of strings"),
    (with_message([{"type": "image", "source": {}}]), "messages[2].content[0].type", "unsupported block type 'image'"),
    (with_message([{"type": "document"}]), "messages[2].content[0].type", "'document'"),
    (with_message([{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]), "", "text block"),
    (with_message([{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]), "", "is_error must be a boolean"),
    (
        with_message([{"type": "tool_use", "id": "t", "name": "Bash", "input": "ls"}], "assistant"),
        "",
        "input must be an object",
    ),
    (with_message([{"type": "server_tool_use"}], "assistant"), "", "unsupported block type 'server_tool_use'"),
    (with_message("hi", "tool"), "messages[2].role", "user, assistant or system"),
    ({**first_request(), "system": [{"type": "image"}]}, "system[0]", "text block"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_REQUESTS)
async def test_bad_requests_get_400_in_anthropic_shape_naming_the_field(served, body, param, message):
    gateway, url, llm = served
    session = gateway.open_session("bad", settings())
    status, error, _ = await post(url, "/v1/messages", body, {"x-api-key": session.key})
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert message in error["error"]["message"]
    with pytest.raises(RequestError) as raised:
        parse_messages_request(body)
    assert raised.value.param == param or not param
    assert llm.calls == []


async def test_refusals_keep_their_status_in_anthropic_shape(served):
    gateway, url, llm = served
    session = gateway.open_session("fail", settings(HistoryPolicy.FAIL, max_calls=2))
    headers = {"x-api-key": session.key}
    assert (await post(url, "/v1/messages", first_request(), headers))[0] == 200
    rewritten = first_request()
    rewritten["messages"][0]["content"] = "Another task."
    status, error, _ = await post(url, "/v1/messages", rewritten, headers)
    assert status == 409 and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("history_rewritten: ")
    status, error, _ = await post(url, "/v1/messages", b"{not json", headers)
    assert status == 400 and "not JSON" in error["error"]["message"]


async def test_refusals_say_not_to_retry_and_an_unavailable_llm_does_not(served):
    # Anthropic's clients retry a 409 (Claude Code ten times, for minutes) unless told not to.
    gateway, url, llm = served
    session = gateway.open_session("retry", settings(HistoryPolicy.FAIL))
    headers = {"x-api-key": session.key}
    llm.fail_with = Unreachable("down")
    rewritten = first_request()
    rewritten["messages"][0]["content"] = "Another task."
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/messages", json=first_request(), headers=headers) as response:
            assert response.status == 503 and "x-should-retry" not in response.headers
            assert (await response.json())["error"]["type"] == "api_error"
        async with http.post(url + "/v1/messages", json=first_request(), headers=headers) as response:
            assert response.status == 200
        for body, status in ((rewritten, 409), (without("max_tokens"), 400), (first_request(), 409)):
            async with http.post(url + "/v1/messages", json=body, headers=headers) as response:
                assert (response.status, response.headers.get("x-should-retry")) == (status, "false")
        async with http.post(url + "/v1/messages", json=first_request(), headers={"x-api-key": "k"}) as response:
            assert (response.status, response.headers.get("x-should-retry")) == (401, "false")


def mutations(rng: random.Random, body: Any, depth: int = 0) -> Any:
    """`body` with one random part replaced, removed or retyped."""
    junk = [None, 0, -1, 1.5, True, "", "x", [], {}, [None], {"type": "nope"}, [{"type": "text"}]]
    if isinstance(body, dict) and body:
        key = rng.choice(sorted(body))
        out = dict(body)
        roll = rng.random()
        if roll < 0.25:
            del out[key]
        elif roll < 0.5 or depth > 4:
            out[key] = rng.choice(junk)
        else:
            out[key] = mutations(rng, body[key], depth + 1)
        return out
    if isinstance(body, list) and body:
        index = rng.randrange(len(body))
        items = list(body)
        items[index] = mutations(rng, body[index], depth + 1) if rng.random() < 0.6 else rng.choice(junk)
        return items
    return rng.choice(junk)


FUZZ_BODIES = 400


async def test_a_fuzz_of_malformed_bodies_never_gets_a_5xx(served):
    gateway, url, _ = served
    rng = random.Random(30)
    statuses: dict[int, int] = {}
    seed = first_request()
    seed["messages"] += [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "t"}, {"type": "tool_use", "id": "a", "name": "Bash", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "o"}]}],
        },
    ]
    async with aiohttp.ClientSession() as http:
        for i in range(FUZZ_BODIES):
            session = gateway.open_session(f"fuzz-{i}", settings(max_calls=1))
            body = mutations(rng, seed)
            path = "/v1/messages/count_tokens" if i % 4 == 0 else "/v1/messages"
            async with http.post(url + path, json=body, headers={"x-api-key": session.key}) as response:
                statuses[response.status] = statuses.get(response.status, 0) + 1
                reply = await response.json() if response.content_type == "application/json" else None
                if response.status >= 400:
                    assert reply is not None and reply["type"] == "error", (body, reply)
                assert response.status < 500, (body, reply)
            gateway.close_session(session.key)
    assert sum(statuses.values()) == FUZZ_BODIES and statuses.get(400, 0) > FUZZ_BODIES // 4, statuses


def test_user_text_and_tool_results_keep_their_order_and_join_like_openai_text_parts():
    request = first_request()
    request["messages"] = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1"},
            {"type": "text", "text": "note"},
        ]},
    ]  # fmt: skip
    messages = parse_messages_request(request).conversation.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[0]["content"] == "You are a coding agent." and messages[1]["content"] == "ab"
    assert messages[2]["tool_calls"] == [
        {"id": "t1", "type": "function", "function": {"name": "Bash", "arguments": {"command": "ls"}}}
    ]
    assert (messages[3]["tool_call_id"], messages[3]["content"], messages[4]["content"]) == ("t1", "", "note")
    ChatRenderer(TOK).encode_prompt(parse_messages_request(request).conversation)  # renders
