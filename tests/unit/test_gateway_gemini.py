"""Gemini's generateContent API through the gateway over HTTP, as Gemini CLI speaks it
(streamGenerateContent?alt=sse, x-goog-api-key): function calls and responses with their ids kept
end to end, one token-exact sample over a multi-call conversation, the same reply whole, streamed
and as a JSON array, countTokens, and Google-shaped errors (never a 5xx, also under fuzzing)."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from corral.rollout.gateway import Gateway, HistoryPolicy
from corral.rollout.gateway.gemini_api import parse_generate_request
from tests.unit.gateway_support import TOK, ScriptedLLM, Unreachable, Window, assert_token_exact, settings

SHELL = {
    "name": "run_shell_command",
    "description": "Runs a shell command.",
    "parametersJsonSchema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
TOOLS = [{"functionDeclarations": [SHELL]}]
CALL = '<tool_call>{"name": "run_shell_command", "arguments": {"command": "ls"}}</tool_call>'
SYSTEM = {"parts": [{"text": "You are a CLI."}]}


def user(*texts: str) -> dict[str, Any]:
    return {"role": "user", "parts": [{"text": text} for text in texts]}


def request(contents: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"contents": contents, "systemInstruction": SYSTEM, "tools": TOOLS, **extra}


@pytest.fixture
async def served() -> AsyncIterator[tuple[Gateway, str, ScriptedLLM]]:
    llm = ScriptedLLM(["Looking.\n" + CALL, "All done."])
    gateway = Gateway(llm, TOK, model_name="tiny", context_length=Window(4096))
    url = (await gateway.listen_tcp()).removesuffix("/v1")
    yield gateway, url, llm
    await gateway.close()


async def post(
    url: str, path: str, body: Any, key: str | None = None, http: aiohttp.ClientSession | None = None
) -> tuple[int, Any]:
    """(status, body): JSON, or the list of SSE `data:` payloads for an event stream."""
    headers = {"x-goog-api-key": key} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    own = http is None
    http = http or aiohttp.ClientSession()
    try:
        async with http.post(url + path, data=data, headers=headers) as response:
            text = await response.text()
            if response.content_type == "text/event-stream":
                events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.strip()]
                return response.status, [json.loads(event) for event in events]
            return response.status, json.loads(text)
    finally:
        if own:
            await http.close()


def parts_of(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [part for chunk in chunks for part in chunk["candidates"][0]["content"]["parts"]]


async def test_a_tool_calling_conversation_streamed_as_gemini_cli_does_is_one_token_exact_sample(served):
    gateway, url, llm = served
    session = gateway.open_session("r-gemini", settings())
    path = "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
    contents = [user("<session_context>cwd</session_context>", "List the files.")]
    status, chunks = await post(url, path, request(contents), session.key)
    assert status == 200
    text, call = parts_of(chunks)
    assert text == {"text": "Looking."}
    assert call["functionCall"]["name"] == "run_shell_command" and call["functionCall"]["args"] == {"command": "ls"}
    call_id = call["functionCall"]["id"]
    assert call_id.startswith("call_")
    last = chunks[-1]
    assert last["candidates"][0]["finishReason"] == "STOP" and "finishReason" not in chunks[0]["candidates"][0]
    prompt, output = len(llm.calls[0].prompt_ids), len(llm.calls[0].generation.output_ids)
    assert last["usageMetadata"] == {
        "promptTokenCount": prompt,
        "candidatesTokenCount": output,
        "totalTokenCount": prompt + output,
    }
    assert last["modelVersion"] == "tiny" and last["corral"] == {"rollout_id": "r-gemini", "call_index": 0}
    # The text parts of one content are read as one text; the system instruction leads.
    first_prompt = TOK.decode(llm.calls[0].prompt_ids)
    assert first_prompt.startswith("<|im_start|>system\nYou are a CLI.")
    assert "<|im_start|>user\n<session_context>cwd</session_context>List the files.<|im_end|>" in first_prompt
    assert '"name": "run_shell_command"' in first_prompt

    # Gemini CLI sends the reply back with a thought signature and answers the call by its id.
    model_turn = {"role": "model", "parts": [text, {**call, "thoughtSignature": "skip_thought_signature_validator"}]}
    result = {"functionResponse": {"id": call_id, "name": "run_shell_command", "response": {"output": "a.txt"}}}
    contents += [model_turn, {"role": "user", "parts": [result]}]
    status, chunks = await post(url, path, request(contents), session.key)
    assert status == 200 and parts_of(chunks) == [{"text": "All done."}]
    assert '<|im_start|>tool\n{"output": "a.txt"}<|im_end|>' in TOK.decode(llm.calls[1].prompt_ids)

    outcome = gateway.close_session(session.key)
    assert (outcome.counters.calls, outcome.counters.prefix_hits, outcome.counters.splits) == (2, 1, 0)
    (sample,) = outcome.samples
    assert_token_exact(sample, llm.calls)


async def test_a_call_sent_back_with_another_id_does_not_extend_the_sample(served):
    gateway, url, llm = served
    session = gateway.open_session("r-ids", settings())
    path = "/v1beta/models/m:generateContent"
    contents = [user("List the files.")]
    status, reply = await post(url, path, request(contents), session.key)
    parts = reply["candidates"][0]["content"]["parts"]
    parts[1]["functionCall"]["id"] = "call_someone_else"
    answer = {"functionResponse": {"id": "call_someone_else", "name": "run_shell_command", "response": {}}}
    contents += [{"role": "model", "parts": parts}, {"role": "user", "parts": [answer]}]
    status, _ = await post(url, path, request(contents), session.key)
    assert status == 200
    outcome = gateway.close_session(session.key)
    assert (outcome.counters.calls, outcome.counters.prefix_hits, outcome.counters.splits) == (2, 0, 1)


def test_function_responses_without_ids_take_the_ids_of_the_calls_in_order():
    calls = [
        {"functionCall": {"id": "call_a", "name": "run_shell_command", "args": {"command": "ls"}}},
        {"functionCall": {"id": "call_b", "name": "run_shell_command", "args": {"command": "pwd"}}},
    ]
    responses = [
        {"functionResponse": {"name": "run_shell_command", "response": {"output": "a.txt"}}},
        {"functionResponse": {"name": "run_shell_command", "response": {"output": "/work"}}},
    ]
    body = request([user("go"), {"role": "model", "parts": calls}, {"role": "user", "parts": responses}])
    messages = parse_generate_request(body).conversation.messages
    assert [m.get("tool_call_id") for m in messages if m["role"] == "tool"] == ["call_a", "call_b"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_a", "call_b"]
    # A response that names its call is matched by the id; the other takes the one left.
    responses[1]["functionResponse"]["id"] = "call_a"
    messages = parse_generate_request(body).conversation.messages
    assert [m.get("tool_call_id") for m in messages if m["role"] == "tool"] == ["call_b", "call_a"]


def test_thoughts_are_left_out_and_thinking_and_sampling_settings_are_ignored():
    config = {"temperature": 0.1, "topK": 3, "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 99}}
    model_turn = {"role": "model", "parts": [{"text": "pondering", "thought": True}, {"text": "Hello."}]}
    body = request([user("hi"), model_turn, user("again")], generationConfig=config, safetySettings=[{"x": 1}])
    parsed = parse_generate_request(body)
    assert [m["content"] for m in parsed.conversation.messages] == ["You are a CLI.", "hi", "Hello.", "again"]
    assert (parsed.options.max_tokens, parsed.options.stop, parsed.options.parse_tool_calls) == (None, (), True)


async def test_whole_streamed_and_array_responses_carry_the_same_reply(served):
    gateway, url, llm = served
    llm.replies = ["Looking.\n" + CALL]
    replies = []
    for path in (":generateContent", ":streamGenerateContent?alt=sse", ":streamGenerateContent"):
        session = gateway.open_session(path, settings())
        status, body = await post(url, "/v1/models/m" + path, request([user("List the files.")]), session.key)
        assert status == 200
        chunks = body if isinstance(body, list) else [body]
        parts = [
            {**p, "functionCall": {**p["functionCall"], "id": "-"}} if "functionCall" in p else p
            for p in parts_of(chunks)
        ]
        replies.append((parts, chunks[-1]["candidates"][0]["finishReason"], chunks[-1]["usageMetadata"]))
    assert replies[0] == replies[1] == replies[2]


async def test_output_limits_and_stop_sequences_reach_the_llm_and_a_cut_reply_says_max_tokens(served):
    gateway, url, llm = served
    session = gateway.open_session("r-limits", settings())
    config = {"maxOutputTokens": 4, "stopSequences": ["END"], "candidateCount": 1}
    status, reply = await post(
        url, "/v1beta/models/m:generateContent", request([user("hi")], generationConfig=config), session.key
    )
    assert status == 200
    assert reply["candidates"][0]["finishReason"] == "MAX_TOKENS"
    assert reply["candidates"][0]["content"]["parts"] == [{"text": "Look"}]
    assert llm.calls[0].max_new_tokens == 4 and "END" in llm.calls[0].stop


async def test_count_tokens_counts_the_prompt_a_call_would_send_and_generates_nothing(served):
    gateway, url, llm = served
    session = gateway.open_session("r-count", settings())
    body = request([user("List the files.")])
    status, counted = await post(url, "/v1beta/models/m:countTokens", {"generateContentRequest": body}, session.key)
    assert status == 200 and not llm.calls and session.counters.calls == 0
    status, contents_only = await post(url, "/v1beta/models/m:countTokens", {"contents": body["contents"]}, session.key)
    assert status == 200 and 0 < contents_only["totalTokens"] < counted["totalTokens"]
    _, reply = await post(url, "/v1beta/models/m:generateContent", body, session.key)
    assert counted["totalTokens"] == reply["usageMetadata"]["promptTokenCount"] == len(llm.calls[0].prompt_ids)


async def test_the_key_comes_from_x_goog_api_key_the_key_parameter_or_the_path(served):
    gateway, url, _ = served
    session = gateway.open_session("r-keys", settings())
    body = {"contents": [user("hi")]}
    assert (await post(url, "/v1beta/models/m:generateContent", body, session.key))[0] == 200
    assert (await post(url, f"/v1beta/models/m:generateContent?key={session.key}", body))[0] == 200
    assert (await post(url, f"/r/{session.key}/v1beta/models/m:generateContent", body))[0] == 200
    for key in ("not-a-key", None):
        status, error = await post(url, "/v1beta/models/m:generateContent", body, key)
        assert status == 401 and error["error"]["status"] == "UNAUTHENTICATED" and error["error"]["code"] == 401
    gateway.close_session(session.key)
    assert (await post(url, "/v1beta/models/m:countTokens", body, session.key))[0] == 401


REFUSED = [
    ({"contents": []}, "contents"),
    ({"contents": "hi"}, "contents"),
    ({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, "contents[0].role"),
    ({"contents": [{"role": "user", "parts": "x"}]}, "contents[0].parts"),
    (
        {"contents": [{"parts": [{"inlineData": {"mimeType": "image/png", "data": ""}}]}]},
        "contents[0].parts[0].inlineData",
    ),
    ({"contents": [{"parts": [{"fileData": {"fileUri": "gs://x"}}]}]}, "contents[0].parts[0].fileData"),
    ({"contents": [{"parts": [{"executableCode": {"code": "1"}}]}]}, "contents[0].parts[0].executableCode"),
    ({"contents": [{"parts": [{"nothing": 1}]}]}, "contents[0].parts[0]"),
    ({"contents": [{"parts": [{"text": 5}]}]}, "contents[0].parts[0].text"),
    ({"contents": [{"parts": [{"functionCall": {"name": "f"}}]}]}, "contents[0].parts[0].functionCall"),
    ({"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": "{}"}}]}]}, "args"),
    (
        {"contents": [{"role": "model", "parts": [{"functionResponse": {"name": "f", "response": {}}}]}]},
        "functionResponse",
    ),
    ({"contents": [{"parts": [{"functionResponse": {"name": "f", "response": "ok"}}]}]}, "response"),
    ({"contents": [{"parts": [{"text": "x"}]}], "tools": [{"googleSearch": {}}]}, "tools[0].googleSearch"),
    ({"contents": [{"parts": [{"text": "x"}]}], "tools": [{"codeExecution": {}}]}, "tools[0].codeExecution"),
    ({"contents": [{"parts": [{"text": "x"}]}], "tools": [{"computerUse": {}}]}, "tools[0].computerUse"),
    ({"contents": [{"parts": [{"text": "x"}]}], "tools": [{"functionDeclarations": [{"description": "x"}]}]}, "name"),
    (
        {"contents": [{"parts": [{"text": "x"}]}], "toolConfig": {"functionCallingConfig": {"mode": "SOMETIMES"}}},
        "mode",
    ),
    ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"candidateCount": 2}}, "candidateCount"),
    ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"maxOutputTokens": 0}}, "maxOutputTokens"),
    ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"stopSequences": "x"}}, "stopSequences"),
    (
        {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"responseMimeType": "application/json"}},
        "responseMimeType",
    ),
    (
        {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"responseJsonSchema": {"type": "object"}}},
        "responseJsonSchema",
    ),
    (
        {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"responseModalities": ["IMAGE"]}},
        "responseModalities",
    ),
    ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"responseLogprobs": True}}, "responseLogprobs"),
    ({"contents": [{"parts": [{"text": "x"}]}], "cachedContent": "cachedContents/1"}, "cachedContent"),
    (
        {"contents": [{"parts": [{"text": "x"}]}], "systemInstruction": {"parts": [{"functionCall": {"name": "f"}}]}},
        "systemInstruction",
    ),
]


@pytest.mark.parametrize(("body", "field"), REFUSED)
async def test_what_cannot_be_honoured_is_refused_with_400_naming_the_field(served, body, field):
    gateway, url, llm = served
    session = gateway.open_session("r-refused", settings())
    status, error = await post(url, "/v1beta/models/m:generateContent", body, session.key)
    assert status == 400, error
    assert error["error"]["code"] == 400 and error["error"]["status"] == "INVALID_ARGUMENT"
    assert field in error["error"]["message"]
    assert error["error"]["details"][0]["reason"] == "INVALID_REQUEST_ERROR"
    assert not llm.calls and session.counters.calls == 0


async def test_unknown_methods_limits_and_llm_failures_answer_in_google_s_shape(served):
    gateway, url, llm = served
    session = gateway.open_session("r-errors", settings(max_calls=1))
    body = {"contents": [user("hi")]}
    status, error = await post(url, "/v1beta/models/m:embedContent", body, session.key)
    assert (status, error["error"]["status"]) == (404, "NOT_FOUND")
    status, error = await post(url, "/v1beta/models/m:generateContent", b"{not json", session.key)
    assert (status, error["error"]["status"]) == (400, "INVALID_ARGUMENT")
    llm.fail_with = Unreachable("all servers down")
    status, error = await post(url, "/v1beta/models/m:generateContent", body, session.key)
    assert (status, error["error"]["status"]) == (503, "UNAVAILABLE")
    assert error["error"]["details"][0]["reason"] == "LLM_UNAVAILABLE"
    assert (await post(url, "/v1beta/models/m:generateContent", body, session.key))[0] == 200
    status, error = await post(url, "/v1beta/models/m:generateContent", body, session.key)
    assert (status, error["error"]["details"][0]["reason"]) == (400, "MAX_TURNS_EXCEEDED")


async def test_a_rewritten_history_under_fail_is_answered_409_aborted(served):
    gateway, url, _ = served
    session = gateway.open_session("r-fail", settings(HistoryPolicy.FAIL))
    path = "/v1beta/models/m:generateContent"
    assert (await post(url, path, request([user("List the files.")]), session.key))[0] == 200
    status, error = await post(url, path, request([user("Something else.")]), session.key)
    assert (status, error["error"]["status"]) == (409, "ABORTED")
    assert error["error"]["details"][0]["reason"] == "HISTORY_REWRITTEN"
    assert gateway.close_session(session.key).history_rewritten


def _mutations(rng: random.Random, body: Any) -> Any:
    """`body` with one random change somewhere: a value replaced by another type, a key dropped
    or added, a list emptied."""
    body = copy.deepcopy(body)
    junk = [None, 0, -1, 1.5, True, "", "x", [], {}, [None], {"text": 1}, {"functionCall": None}]
    node, path = body, []
    while isinstance(node, (dict, list)) and node and rng.random() < 0.8:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        if not isinstance(node[key], (dict, list)) or not node[key]:
            break
        path.append(key)
        node = node[key]
    if isinstance(node, dict) and node:
        key = rng.choice(list(node))
        choice = rng.random()
        if choice < 0.4:
            node[key] = rng.choice(junk)
        elif choice < 0.7:
            del node[key]
        else:
            node[rng.choice(["role", "parts", "functionResponse", "googleSearch", "thought", "id"])] = rng.choice(junk)
    elif isinstance(node, list) and node:
        node[rng.randrange(len(node))] = rng.choice(junk)
    return body if rng.random() < 0.95 else rng.choice(junk)


async def test_fuzzed_bodies_get_a_reply_or_a_google_shaped_4xx_never_a_5xx(served):
    gateway, url, llm = served
    llm.replies = ["Fine."]
    rng = random.Random(20261207)
    call = {"functionCall": {"id": "call_1", "name": "run_shell_command", "args": {"command": "ls"}}}
    answer = {"functionResponse": {"id": "call_1", "name": "run_shell_command", "response": {"output": "a"}}}
    base = request(
        [user("a", "b"), {"role": "model", "parts": [{"text": "t"}, call]}, {"role": "user", "parts": [answer]}],
        generationConfig={"maxOutputTokens": 64, "stopSequences": ["X"], "thinkingConfig": {"includeThoughts": True}},
        toolConfig={"functionCallingConfig": {"mode": "AUTO"}},
    )
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession() as http:
        session = gateway.open_session("r-fuzz", settings(max_calls=10_000))
        for i in range(300):
            method = ("generateContent", "streamGenerateContent", "countTokens")[i % 3]
            status, data = await post(url, f"/v1beta/models/m:{method}", _mutations(rng, base), session.key, http)
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500, data
            if status >= 400:
                assert (
                    set(data["error"]) == {"code", "message", "status", "details"} and data["error"]["code"] == status
                )
    assert statuses.get(400, 0) > 50 and statuses.get(200, 0) > 50, statuses
