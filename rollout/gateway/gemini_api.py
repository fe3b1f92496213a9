"""Google's Gemini API wire format (generateContent, streamGenerateContent, countTokens), as Gemini
CLI and the Google Gen AI SDKs send it, read into the chat core's `Conversation` and written back.

A request's `contents` become OpenAI-normalized messages (render.normalize_messages):

- `systemInstruction` (its text parts) is the system message;
- a `user` content's text parts are a user message; each `functionResponse` part is a tool message
  (its `response` object written as JSON, `tool_call_id` its `id`, or, when it has none, the id of
  the previous model turn's function call at the same position among the unanswered ones);
- a `model` content's text parts are the assistant content and its `functionCall` parts its
  tool_calls (`args` an object, `id` kept: Gemini CLI sends back the ids the gateway gave).

Text parts of one content are concatenated as they are (a streamed reply's parts join that way).
Parts marked `thought` are left out: the gateway never returns thoughts (the reply's text is all
text), and Gemini does not show earlier thoughts to the model either. `thoughtSignature` is ignored.

What cannot be honoured is refused (400 naming the field): media and code-execution parts,
server-side tools (Google Search, code execution, URL context...), structured output
(`responseSchema`, `responseJsonSchema`, a `responseMimeType` other than text/plain), other
modalities, `cachedContent`, `candidateCount` other than 1, `responseLogprobs`. Sampling fields
(temperature, topP, topK, seed, penalties), `thinkingConfig` and `safetySettings` are ignored: the
task's sampling and chat template decide.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from corral.rollout.gateway.errors import RequestError
from corral.rollout.gateway.openai_api import ResponseContext
from corral.rollout.gateway.render import Conversation, Message, normalize_messages
from corral.rollout.gateway.session import CallOptions, CallResult

# Parts the gateway reads; parts with these other data fields are refused.
UNSUPPORTED_PARTS = ("inlineData", "fileData", "executableCode", "codeExecutionResult", "videoMetadata")
# Tool kinds besides functionDeclarations: all run on Google's side.
SERVER_TOOLS = (
    "googleSearch",
    "googleSearchRetrieval",
    "codeExecution",
    "urlContext",
    "computerUse",
    "fileSearch",
    "googleMaps",
    "retrieval",
    "enterpriseWebSearch",
    "mcpServers",
)
CALLING_MODES = ("MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED")
# generationConfig fields that constrain the output in ways the gateway cannot (they are refused).
UNSUPPORTED_OUTPUT = ("responseSchema", "responseJsonSchema", "_responseJsonSchema", "speechConfig", "imageConfig")


@dataclass(frozen=True)
class GeminiRequest:
    conversation: Conversation
    options: CallOptions


def parse_generate_request(body: Any) -> GeminiRequest:
    """A generateContent / streamGenerateContent body."""
    body = _object(body, "the request body")
    if body.get("cachedContent") is not None:
        raise RequestError("'cachedContent' is not supported: send the whole conversation", "cachedContent")
    tools = _tools(body.get("tools"))
    mode = _calling_mode(body.get("toolConfig"))
    max_tokens, stop = _generation_config(body.get("generationConfig"))
    messages = [*_system(body.get("systemInstruction")), *_contents(body.get("contents"))]
    options = CallOptions(max_tokens, stop, parse_tool_calls=bool(tools) and mode != "NONE")
    return GeminiRequest(Conversation(normalize_messages(messages), tools), options)


def parse_count_tokens_request(body: Any) -> Conversation:
    """A countTokens body: `contents`, or a whole `generateContentRequest`."""
    body = _object(body, "the request body")
    inner = body.get("generateContentRequest")
    if inner is not None:
        return parse_generate_request(inner).conversation
    return Conversation(normalize_messages(_contents(body.get("contents"))))


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RequestError(f"{where} must be a JSON object", where if where != "the request body" else None)
    return value


def _system(raw: Any) -> list[Message]:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"role": "system", "content": raw}]
    content = _object(raw, "systemInstruction")
    text, _, _ = _parts(content.get("parts"), "systemInstruction", allowed=())
    return [{"role": "system", "content": text}]


def _contents(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("'contents' must be a non-empty array of Content objects", "contents")
    messages: list[Message] = []
    unanswered: list[str | None] = []  # the last model turn's call ids not yet answered, in order
    for i, content in enumerate(raw):
        where = f"contents[{i}]"
        content = _object(content, where)
        role = content.get("role") or "user"
        if role == "model":
            text, calls, _ = _parts(content.get("parts"), where, allowed=("functionCall",))
            message: Message = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
            unanswered = [call.get("id") for call in calls]
        elif role == "user":
            text, _, responses = _parts(content.get("parts"), where, allowed=("functionResponse",))
            # Responses that name their call answer it; the others take the calls left, in order.
            named = {response.get("tool_call_id") for response in responses}
            unanswered = [call_id for call_id in unanswered if call_id not in named]
            for response in responses:
                if "tool_call_id" not in response and unanswered:
                    call_id = unanswered.pop(0)
                    if call_id is not None:
                        response["tool_call_id"] = call_id
                messages.append(response)
            if text or not responses:
                messages.append({"role": "user", "content": text})
        else:
            raise RequestError(f"{where}.role must be 'user' or 'model' (got {role!r})", f"{where}.role")
    return messages


def _parts(raw: Any, where: str, *, allowed: tuple[str, ...]) -> tuple[str, list[Message], list[Message]]:
    """A content's parts: its text (text parts concatenated, thoughts left out), its function
    calls as OpenAI tool calls, its function responses as tool messages."""
    if not isinstance(raw, list):
        raise RequestError(f"{where}.parts must be an array of Part objects", f"{where}.parts")
    texts: list[str] = []
    calls: list[Message] = []
    responses: list[Message] = []
    for j, part in enumerate(raw):
        at = f"{where}.parts[{j}]"
        part = _object(part, at)
        for name in UNSUPPORTED_PARTS:
            if name in part:
                raise RequestError(f"{at}.{name} is not supported: only text and function parts are", f"{at}.{name}")
        if "text" in part:
            if not isinstance(part["text"], str):
                raise RequestError(f"{at}.text must be a string", f"{at}.text")
            if not part.get("thought"):
                texts.append(part["text"])
        elif "functionCall" in part:
            _allowed(allowed, "functionCall", at)
            calls.append(_function_call(part["functionCall"], f"{at}.functionCall"))
        elif "functionResponse" in part:
            _allowed(allowed, "functionResponse", at)
            responses.append(_function_response(part["functionResponse"], f"{at}.functionResponse"))
        else:
            raise RequestError(f"{at} must have 'text', 'functionCall' or 'functionResponse'", at)
    return "".join(texts), calls, responses


def _allowed(allowed: tuple[str, ...], kind: str, at: str) -> None:
    if kind not in allowed:
        owner = "a model" if kind == "functionCall" else "a user"
        raise RequestError(f"{at}.{kind}: a {kind} part belongs in {owner} content", f"{at}.{kind}")


def _function_call(raw: Any, where: str) -> Message:
    call = _object(raw, where)
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name must be a non-empty string", f"{where}.name")
    args = call.get("args")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise RequestError(f"{where}.args must be an object", f"{where}.args")
    entry: Message = {"type": "function", "function": {"name": name, "arguments": args}}
    call_id = _call_id(call, where)
    if call_id is not None:
        entry["id"] = call_id
    return entry


def _function_response(raw: Any, where: str) -> Message:
    response = _object(raw, where)
    name = response.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name must be a non-empty string", f"{where}.name")
    result = response.get("response")
    if not isinstance(result, dict):
        raise RequestError(f"{where}.response must be an object", f"{where}.response")
    if response.get("parts"):
        raise RequestError(f"{where}.parts (media in a function response) is not supported", f"{where}.parts")
    message: Message = {"role": "tool", "content": json.dumps(result, ensure_ascii=False), "name": name}
    call_id = _call_id(response, where)
    if call_id is not None:
        message["tool_call_id"] = call_id
    return message


def _call_id(part: Mapping[str, Any], where: str) -> str | None:
    call_id = part.get("id")
    if call_id is None or call_id == "":
        return None
    if not isinstance(call_id, str):
        raise RequestError(f"{where}.id must be a string", f"{where}.id")
    return call_id


def _tools(raw: Any) -> tuple[Message, ...]:
    """Function declarations as OpenAI function tools, in order."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RequestError("'tools' must be an array of Tool objects", "tools")
    tools: list[Message] = []
    for i, tool in enumerate(raw):
        tool = _object(tool, f"tools[{i}]")
        for name in SERVER_TOOLS:
            if name in tool:
                raise RequestError(
                    f"tools[{i}].{name} is not supported: only functionDeclarations (tools the harness runs)",
                    f"tools[{i}].{name}",
                )
        declarations = tool.get("functionDeclarations", [])
        if not isinstance(declarations, list):
            raise RequestError(f"tools[{i}].functionDeclarations must be an array", f"tools[{i}].functionDeclarations")
        for j, declaration in enumerate(declarations):
            tools.append(_declaration(declaration, f"tools[{i}].functionDeclarations[{j}]"))
    return tuple(tools)


def _declaration(raw: Any, where: str) -> Message:
    declaration = _object(raw, where)
    name = declaration.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name must be a non-empty string", f"{where}.name")
    if declaration.get("parameters") is not None and declaration.get("parametersJsonSchema") is not None:
        raise RequestError(f"{where}: give 'parameters' or 'parametersJsonSchema', not both", where)
    function: Message = {"name": name}
    if declaration.get("description") is not None:
        if not isinstance(declaration["description"], str):
            raise RequestError(f"{where}.description must be a string", f"{where}.description")
        function["description"] = declaration["description"]
    parameters = declaration.get("parametersJsonSchema", declaration.get("parameters"))
    if parameters is not None:
        function["parameters"] = _object(parameters, f"{where}.parameters")
    return {"type": "function", "function": function}


def _calling_mode(raw: Any) -> str:
    if raw is None:
        return "AUTO"
    config = _object(raw, "toolConfig").get("functionCallingConfig")
    if config is None:
        return "AUTO"
    mode = _object(config, "toolConfig.functionCallingConfig").get("mode") or "AUTO"
    if mode not in CALLING_MODES:
        raise RequestError(
            f"toolConfig.functionCallingConfig.mode must be one of {', '.join(CALLING_MODES)}",
            "toolConfig.functionCallingConfig.mode",
        )
    return str(mode)


def _generation_config(raw: Any) -> tuple[int | None, tuple[str, ...]]:
    """(maxOutputTokens, stopSequences); what cannot be honoured is refused."""
    if raw is None:
        return None, ()
    config = _object(raw, "generationConfig")
    for name in UNSUPPORTED_OUTPUT:
        if config.get(name) is not None:
            raise RequestError(
                f"generationConfig.{name} (constrained output) is not supported", f"generationConfig.{name}"
            )
    mime = config.get("responseMimeType")
    if mime is not None and mime != "text/plain":
        raise RequestError(
            "generationConfig.responseMimeType: only text/plain is supported", "generationConfig.responseMimeType"
        )
    modalities = config.get("responseModalities")
    if modalities is not None and (not isinstance(modalities, list) or any(m != "TEXT" for m in modalities)):
        raise RequestError(
            "generationConfig.responseModalities: only TEXT is supported", "generationConfig.responseModalities"
        )
    if config.get("responseLogprobs"):
        raise RequestError("generationConfig.responseLogprobs is not supported", "generationConfig.responseLogprobs")
    count = config.get("candidateCount")
    if count is not None and count != 1:
        raise RequestError(
            "generationConfig.candidateCount must be 1: each call is one step of one rollout",
            "generationConfig.candidateCount",
        )
    max_tokens = config.get("maxOutputTokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(
            "generationConfig.maxOutputTokens must be a positive integer", "generationConfig.maxOutputTokens"
        )
    stop = config.get("stopSequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError(
            "generationConfig.stopSequences must be an array of strings", "generationConfig.stopSequences"
        )
    return max_tokens, tuple(s for s in stop if s)


# Responses.


def reply_parts(reply: Message) -> list[dict[str, Any]]:
    """The reply as Gemini parts: its text, then one functionCall per tool call (with its id)."""
    parts: list[dict[str, Any]] = [{"text": reply["content"]}] if reply["content"] else []
    for call in reply.get("tool_calls", ()):
        function = call["function"]
        parts.append({"functionCall": {"id": call["id"], "name": function["name"], "args": function["arguments"]}})
    return parts or [{"text": ""}]


def finish_reason(result: CallResult) -> str:
    return "MAX_TOKENS" if result.generation.finish_reason == "length" else "STOP"


def usage_metadata(result: CallResult) -> dict[str, int]:
    prompt, candidates = len(result.prompt_ids), len(result.generation.output_ids)
    return {"promptTokenCount": prompt, "candidatesTokenCount": candidates, "totalTokenCount": prompt + candidates}


def generate_response(context: ResponseContext, result: CallResult, reply: Message) -> dict[str, Any]:
    """The whole GenerateContentResponse."""
    return _response(context, result, reply_parts(reply), final=True)


def stream_chunks(context: ResponseContext, result: CallResult, reply: Message) -> Iterator[dict[str, Any]]:
    """The response as streamGenerateContent chunks, one per part; the last one carries the
    finish reason and the usage (Gemini CLI takes a stream without a finish reason for a broken
    one)."""
    parts = reply_parts(reply)
    for i, part in enumerate(parts):
        yield _response(context, result, [part], final=i == len(parts) - 1)


def _response(
    context: ResponseContext, result: CallResult, parts: list[dict[str, Any]], *, final: bool
) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    response: dict[str, Any] = {"candidates": [candidate], "modelVersion": context.model, "responseId": context.id}
    if final:
        candidate["finishReason"] = finish_reason(result)
        response["usageMetadata"] = usage_metadata(result)
        response["corral"] = {"rollout_id": context.rollout_id, "call_index": result.call_index}
    return response
