"""The gateway's HTTP side: an aiohttp server in front of a GenerateFn, one session per rollout,
found by its key (the API's own key header, or /r/<key>/... in the path).

Routes (each also under /r/<key>):
- OpenAI: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models
  (key: the Bearer token; errors {"error": {"message", "type", "param", "code"}});
- Anthropic: POST /v1/messages and POST /v1/messages/count_tokens (key: x-api-key or the Bearer
  token; errors {"type": "error", "error": {"type", "message"}});
- Gemini: POST /v1beta/models/<model>:generateContent, :streamGenerateContent (?alt=sse: server-sent
  events; otherwise a JSON array of the chunks) and :countTokens, also under /v1/ (key:
  x-goog-api-key or ?key=; errors {"error": {"code", "message", "status", "details"}}).
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web

import corral.rollout.gateway.anthropic_api as anthropic_api
from corral.rollout.gateway.assembly import GatewayCounters
from corral.rollout.gateway.errors import GatewayError, NotFound, RequestError, UnknownKey, google_error_body
from corral.rollout.gateway.gemini_api import (
    generate_response,
    parse_count_tokens_request,
    parse_generate_request,
    stream_chunks,
)
from corral.rollout.gateway.openai_api import (
    ChatStream,
    CompletionStream,
    ResponseContext,
    chat_response,
    completion_response,
    parse_chat_request,
    parse_completion_request,
    sse_event,
)
from corral.rollout.gateway.responses_api import (
    ResponseIds,
    output_items,
    parse_responses_request,
    response_events,
    response_object,
    sse_named_event,
)
from corral.rollout.gateway.session import GatewayOutcome, GatewaySession, SessionSettings
from corral.rollout.gateway.streaming import CallDone, StreamEvent, TextDelta
from corral.rollout.types import ChatTokenizer, GenerateFn, StreamingGenerateFn

# Long agent conversations are sent whole on every call.
MAX_REQUEST_BYTES = 256 * 1024 * 1024


class Gateway:
    """The HTTP front (OpenAI's, Anthropic's and Gemini's APIs) for a GenerateFn (the daemon's LLMPool.generate), one session
    per rollout. Calls of one session run one at a time, in arrival order; sessions run
    concurrently. `totals` sums the counters of closed sessions."""

    def __init__(
        self,
        generate: GenerateFn | StreamingGenerateFn,
        tokenizer: ChatTokenizer,
        *,
        policy_version: Callable[[], int] = lambda: 0,
        context_length: Callable[[], Awaitable[int | None]] | None = None,
        model_name: str = "corral",
    ) -> None:
        self.generate = generate
        self.tokenizer = tokenizer
        self.policy_version = policy_version
        self.context_length = context_length
        self.model_name = model_name
        self.totals = GatewayCounters()
        self._sessions: dict[str, GatewaySession] = {}
        self._app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        for prefix in ("", "/r/{key}"):
            self._app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            self._app.router.add_post(prefix + "/v1/completions", self._completions)
            self._app.router.add_post(prefix + "/v1/responses", self._responses)
            self._app.router.add_get(prefix + "/v1/models", self._models)
            self._app.router.add_post(prefix + "/v1/messages", self._messages)
            self._app.router.add_post(prefix + "/v1/messages/count_tokens", self._count_tokens)
            for version in ("/v1beta", "/v1"):
                self._app.router.add_post(prefix + version + "/models/{target}", self._gemini)
        self._runner: web.AppRunner | None = None

    @property
    def app(self) -> web.Application:
        return self._app

    @property
    def sessions(self) -> Iterable[GatewaySession]:
        return self._sessions.values()

    def open_session(self, rollout_id: str, settings: SessionSettings) -> GatewaySession:
        session = GatewaySession(
            rollout_id,
            settings,
            generate=self.generate,
            tokenizer=self.tokenizer,
            policy_version=self.policy_version,
            context_length=self.context_length,
        )
        self._sessions[session.key] = session
        return session

    def close_session(self, key: str) -> GatewayOutcome:
        """The session's outcome; its key is refused (401) from now on. A call still in flight is
        answered 401 and recorded nowhere."""
        session = self._sessions.pop(key, None)
        if session is None:
            raise KeyError("no open gateway session has this key")
        outcome = session.close()
        self.totals.add(session.counters)
        return outcome

    # Serving.

    async def _runner_started(self) -> web.AppRunner:
        if self._runner is None:
            self._runner = web.AppRunner(self._app, access_log=None)
            await self._runner.setup()
        return self._runner

    async def listen_tcp(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serves on host:port (0: any free port); returns the base URL ending in /v1."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen(128)
            await self.listen_socket(sock)
        except BaseException:
            sock.close()
            raise
        bound = sock.getsockname()[1]
        return f"http://[{host}]:{bound}/v1" if family == socket.AF_INET6 else f"http://{host}:{bound}/v1"

    async def listen_socket(self, sock: socket.socket) -> None:
        """Serves on an already bound, listening socket (e.g. one made in a sandbox's network namespace)."""
        await web.SockSite(await self._runner_started(), sock).start()

    async def listen_unix(self, path: str) -> None:
        await web.UnixSite(await self._runner_started(), path).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # Handlers.

    def _session_for(
        self, request: web.Request, api_key: Callable[[web.Request], str | None] | None = None
    ) -> GatewaySession:
        """The session of the key in the path, else of the API's key header (`api_key`; the
        Bearer token by default)."""
        key = request.match_info.get("key")
        if key is None:
            key = (api_key or _bearer)(request)
        session = self._sessions.get(key or "")
        if session is None or session.closed:
            raise UnknownKey()
        return session

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session_for(request)
            parsed = parse_chat_request(await _json_body(request))
            context = ResponseContext.new(self.model_name, session.rollout_id, "chatcmpl")
            if parsed.stream.stream:
                chunks = ChatStream(context, parsed, self.tokenizer, _next_call_index(session))

                def chat_events(event: StreamEvent) -> Iterable[Any]:
                    if isinstance(event, TextDelta):
                        return chunks.text(event.text)
                    assert event.reply is not None  # a chat call's
                    return chunks.done(event.result, event.reply)

                return await _sse(request, session.chat_stream(parsed.conversation, parsed.options), chat_events)
            result, reply = await session.chat(parsed.conversation, parsed.options)
        except GatewayError as error:
            return _error_response(error)
        return _json_response(chat_response(context, result, reply, parsed, self.tokenizer))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session_for(request)
            parsed = parse_completion_request(await _json_body(request))
            context = ResponseContext.new(self.model_name, session.rollout_id, "cmpl")
            if parsed.stream.stream:
                chunks = CompletionStream(context, parsed, self.tokenizer, _next_call_index(session))

                def completion_events(event: StreamEvent) -> Iterable[Any]:
                    return chunks.text(event.text) if isinstance(event, TextDelta) else chunks.done(event.result)

                return await _sse(request, session.complete_stream(parsed.prompt, parsed.options), completion_events)
            result = await session.complete(parsed.prompt, parsed.options)
        except GatewayError as error:
            return _error_response(error)
        return _json_response(completion_response(context, result, parsed, self.tokenizer))

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session_for(request)
            parsed = parse_responses_request(await _json_body(request))
            result, reply = await session.chat(parsed.conversation, parsed.options)
        except GatewayError as error:
            return _error_response(error)
        ids = ResponseIds.new()
        output = output_items(result, reply, parsed, self.tokenizer)
        if parsed.stream:
            events = response_events(ids, self.model_name, session.rollout_id, parsed, result, output)
            return await _sse_whole(request, (sse_named_event(event) for event in events))
        return _json_response(response_object(ids, self.model_name, session.rollout_id, parsed, result, output))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session_for(request, _anthropic_key)
            parsed = anthropic_api.parse_messages_request(await _json_body(request))
            result, reply = await session.chat(parsed.conversation, parsed.options)
        except GatewayError as error:
            return _anthropic_error_response(error)
        stops = (*parsed.options.stop, *session.settings.sampling.stop)
        stop = anthropic_api.stop_sequence(result, stops, self.tokenizer)
        context = anthropic_api.MessageContext.new(self.model_name, session.rollout_id)
        if parsed.stream:
            events = anthropic_api.message_events(context, result, reply, stop)
            return await _sse_whole(request, (anthropic_api.sse_frame(event, data) for event, data in events))
        return _json_response(anthropic_api.message_response(context, result, reply, stop))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's length in the task's tokenizer, as the next call would render it in full;
        not a call of the rollout (nothing is generated or recorded)."""
        try:
            session = self._session_for(request, _anthropic_key)
            parsed = anthropic_api.parse_messages_request(await _json_body(request), count_only=True)
            tokens = len(session.renderer.encode_prompt(parsed.conversation))
        except GatewayError as error:
            return _anthropic_error_response(error)
        return _json_response({"input_tokens": tokens})

    async def _gemini(self, request: web.Request) -> web.StreamResponse:
        """POST .../models/<model>:<method>, Gemini's generateContent, streamGenerateContent and
        countTokens; errors in Google's shape."""
        try:
            session = self._session_for(request, _google_key)
            _, _, method = request.match_info["target"].partition(":")
            if method == "countTokens":
                conversation = parse_count_tokens_request(await _json_body(request))
                return _json_response({"totalTokens": len(session.renderer.encode_prompt(conversation))})
            if method not in ("generateContent", "streamGenerateContent"):
                raise NotFound(f"unknown method {method!r}: generateContent, streamGenerateContent, countTokens")
            parsed = parse_generate_request(await _json_body(request))
            result, reply = await session.chat(parsed.conversation, parsed.options)
        except GatewayError as error:
            return _json_response(google_error_body(error), error.status)
        context = ResponseContext.new(self.model_name, session.rollout_id, "gemini")
        if method == "generateContent":
            return _json_response(generate_response(context, result, reply))
        chunks = stream_chunks(context, result, reply)
        if request.query.get("alt") == "sse":
            return await _sse_whole(request, (sse_event(chunk) for chunk in chunks))
        return _json_response(list(chunks))

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session_for(request)
        except GatewayError as error:
            return _error_response(error)
        model: dict[str, Any] = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "corral"}
        window = await self.context_length() if self.context_length is not None else None
        if window:
            model["max_model_len"] = window
        return _json_response({"object": "list", "data": [model]})


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _anthropic_key(request: web.Request) -> str | None:
    """Anthropic's API key: the x-api-key header (ANTHROPIC_API_KEY's), else the Bearer token
    (ANTHROPIC_AUTH_TOKEN's)."""
    return request.headers.get("x-api-key") or _bearer(request)


def _google_key(request: web.Request) -> str | None:
    """Google's API key: the x-goog-api-key header (the Gen AI SDKs') or the ?key= parameter."""
    return request.headers.get("x-goog-api-key") or request.query.get("key")


def _next_call_index(session: GatewaySession) -> Callable[[], int]:
    """The index a streaming call's commit will give it, asked at its first content delta: the
    call then holds the session's lock, so no other call commits before it."""
    return lambda: session.counters.calls


async def _json_body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not JSON: {error}") from None
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(f"the request body is larger than {MAX_REQUEST_BYTES} bytes") from None


def _json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def _anthropic_error_response(error: GatewayError) -> web.Response:
    # Anthropic's clients retry 409 (and Claude Code retries ten times, backing off for minutes)
    # unless told not to: a refusal of the gateway's is final, an unavailable LLM may come back.
    final = {"x-should-retry": "false"} if error.status < 500 else None
    return _json_response(error.anthropic_body(), error.status, final)


def _error_response(error: GatewayError) -> web.Response:
    return _json_response(error.body(), error.status)


async def _sse_whole(request: web.Request, events: Iterable[bytes]) -> web.StreamResponse:
    """A reply generated whole, sent as its events in one write (the Responses, Messages and Gemini APIs)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    await response.write(b"".join(events))
    await response.write_eof()
    return response


async def _sse(
    request: web.Request,
    events: AsyncGenerator[StreamEvent, None],
    chunks: Callable[[StreamEvent], Iterable[Any]],
    *,
    encode: Callable[[Any], bytes] = sse_event,
    error_event: Callable[[GatewayError], bytes] = lambda error: sse_event(error.body()),
    last: bytes | None = sse_event("[DONE]"),
) -> web.StreamResponse:
    """Sends a streaming call's events as server-sent events: `chunks` maps each to the API's
    objects, `encode` writes one (OpenAI's `data:` lines by default), `error_event` a failure
    after the stream began, `last` ends the stream (`data: [DONE]`). The response starts with the
    first event, so a call refused or failing before its first token is answered with its status
    like a whole one (the GatewayError raised here goes to the caller). A client that goes away
    closes `events`, which cancels the generation."""
    response: web.StreamResponse | None = None
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                if response is None:
                    response = web.StreamResponse(
                        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                    )
                    await response.prepare(request)
                done = isinstance(event, CallDone)
                # One write per event (the final one's chunks and the closing event together).
                data = b"".join(encode(chunk) for chunk in chunks(event))
                await response.write(data + (last or b"") if done else data)
                if done:
                    break
        except GatewayError as error:
            if response is None:
                raise
            with contextlib.suppress(ConnectionError):
                await response.write(error_event(error) + (last or b""))
        except ConnectionError:  # the client went away
            return response if response is not None else web.Response(status=499)
    assert response is not None  # a stream ends with CallDone, or an error after its first event
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response
