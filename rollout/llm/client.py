"""What the LLM clients share: the client interface, the errors, and one JSON-over-HTTP call that
sorts failures into retryable (the server's fault: try another) and not (the request's fault).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp

from corral.rollout.types import DeltaSink, Generation, LLMUnavailable, SamplingOptions


class LLMServerError(Exception):
    """One call to one LLM server failed.

    `retryable`: the server (or the way to it) is at fault: connection refused or dropped, a
    timeout, a 5xx, 408/429, or a response that does not follow the protocol. The pool retries
    those on another server and takes the server out of rotation for a while (except 408/429,
    which only move the request elsewhere). Not retryable: any other 4xx, which would fail the
    same way anywhere.
    """

    def __init__(
        self,
        message: str,
        *,
        server: str = "",
        status: int | None = None,
        retryable: bool = True,
        take_out: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.server = server
        self.status = status
        self.retryable = retryable
        # Whether the failure says the server is unwell (not merely busy).
        self.take_out = retryable and status not in (408, 429) if take_out is None else take_out


class LLMRequestRejected(LLMUnavailable):
    """An LLM server refused the request itself (a 4xx other than 408/429: e.g. the prompt is
    longer than its context, or an unknown model). Not retried on another server. A subclass of
    LLMUnavailable, so whoever maps LLMUnavailable to FILTER_REASON_LLM_UNREACHABLE maps this too;
    `status` and `server` say what happened."""

    def __init__(self, message: str, *, server: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.server = server
        self.status = status


class LLMClient(Protocol):
    """A token-in/token-out client for one server."""

    base_url: str

    async def generate(
        self, input_ids: list[int], sampling: SamplingOptions, on_delta: DeltaSink | None = None
    ) -> Generation:
        """Raises LLMServerError. With `on_delta` the server streams: each delta of ids is passed
        on as it arrives, and the Generation returned is the one the same answer whole gives."""
        ...

    async def health(self) -> bool:
        """The server's health endpoint answers 200 (False for any failure)."""
        ...

    async def context_length(self) -> int | None:
        """The longest sequence (prompt and generated tokens) the server accepts; None when it
        does not say. Raises LLMServerError when it cannot be asked."""
        ...

    async def close(self) -> None: ...


class HTTPClientBase:
    """Holds the base URL and the aiohttp session (shared when given, else owned and closed by
    `close`)."""

    def __init__(
        self, base_url: str, *, session: aiohttp.ClientSession | None = None, timeout_s: float = 600.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._session = session
        self._owns_session = session is None
        # GET /v1/models' "data", once it answered (None: not asked yet; []: the server has none).
        self._models: list[dict[str, Any]] | None = None

    async def models(self) -> list[dict[str, Any]]:
        """The entries of GET /v1/models (asked once); [] when the server has no such endpoint
        (404). Raises LLMServerError for other failures (asked again next time)."""
        if self._models is None:
            try:
                data = await self._request("GET", "/v1/models", timeout_s=30)
            except LLMServerError as error:
                if error.status != 404:
                    raise
                data = {}
            entries = data.get("data") if isinstance(data, dict) else None
            self._models = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
        return self._models

    async def context_length(self) -> int | None:
        """`max_model_len` of the served model as GET /v1/models reports it (vLLM, and SGLang's
        OpenAI-compatible server); None when it reports none."""
        models = await self.models()
        model = getattr(self, "model", "")
        entry = next((m for m in models if model and m.get("id") == model), models[0] if models else None)
        length = int_or_none(entry.get("max_model_len")) if entry is not None else None
        return length if length is not None and length > 0 else None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            if not self._owns_session:
                raise LLMServerError("the shared HTTP session is closed", server=self.base_url, retryable=False)
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        json_answer: bool = True,
    ) -> Any:
        """The decoded JSON answer (the raw body when not `json_answer`); LLMServerError
        (retryable or not) for every failure."""
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=self.timeout_s if timeout_s is None else timeout_s)
        try:
            async with self._get_session().request(method, url, json=payload, timeout=timeout) as response:
                body = await response.read()
                status = response.status
        except TimeoutError:
            raise LLMServerError(f"{method} {url} timed out", server=self.base_url) from None
        except (aiohttp.ClientError, OSError) as error:
            raise LLMServerError(
                f"{method} {url} failed: {type(error).__name__}: {error}", server=self.base_url
            ) from None
        if status >= 400:
            raise self._status_error(f"{method} {url}", status, body)
        if not json_answer:
            return body
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LLMServerError(
                f"{method} {url} answered something that is not JSON: {body[:200]!r}",
                server=self.base_url,
                status=status,
            ) from None

    def _status_error(self, what: str, status: int, body: bytes) -> LLMServerError:
        detail = body[:500].decode(errors="replace")
        retryable = status >= 500 or status in (408, 429)
        return LLMServerError(
            f"{what} answered {status}: {detail}", server=self.base_url, status=status, retryable=retryable
        )

    async def _stream(self, path: str, payload: dict[str, Any]) -> AsyncIterator[Any]:
        """POSTs `payload` and yields the decoded JSON of each server-sent event's data as it
        arrives, until `data: [DONE]` or the end of the answer. LLMServerError for every failure,
        as `_request`, and for an error event ({"error": ...}: the server failed mid-stream).
        Closing the iterator early closes the connection (the server then aborts the request)."""
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self._get_session().post(url, json=payload, timeout=timeout) as response:
                if response.status >= 400:
                    raise self._status_error(f"POST {url}", response.status, await response.read())
                buffer = b""
                async for piece in response.content.iter_any():
                    buffer += piece
                    *events, buffer = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
                    for event in events:
                        data = _event_data(event)
                        if data is None:
                            continue
                        if data == b"[DONE]":
                            return
                        yield self._event_json(url, data)
                data = _event_data(buffer)
                if data is not None and data != b"[DONE]":
                    yield self._event_json(url, data)
        except TimeoutError:
            raise LLMServerError(f"POST {url} timed out", server=self.base_url) from None
        except (aiohttp.ClientError, OSError) as error:
            raise LLMServerError(f"POST {url} failed: {type(error).__name__}: {error}", server=self.base_url) from None

    def _event_json(self, url: str, data: bytes) -> Any:
        try:
            decoded = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LLMServerError(
                f"POST {url} streamed something that is not JSON: {data[:200]!r}", server=self.base_url
            ) from None
        if isinstance(decoded, dict) and (
            ("error" in decoded and "choices" not in decoded and "meta_info" not in decoded)
            or decoded.get("object") == "error"
        ):
            raise LLMServerError(
                f"POST {url} failed mid-stream: {str(decoded.get('error', decoded))[:500]}", server=self.base_url
            )
        return decoded


def _event_data(event: bytes) -> bytes | None:
    """The data of one server-sent event (its `data:` lines joined); None when it has none."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def protocol_error(server: str, message: str) -> LLMServerError:
    """A 200 answer that does not follow the protocol (retryable: the server is misbehaving)."""
    return LLMServerError(f"{server}: {message}", server=server)


def int_or_none(value: Any) -> int | None:
    """An int when `value` is an int or a string of one, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def optional_sampling_fields(sampling: SamplingOptions) -> dict[str, Any]:
    """The sampling options both protocols send only when set, under the same names."""
    fields: dict[str, Any] = {}
    if sampling.top_k > 0:
        fields["top_k"] = sampling.top_k
    if sampling.stop:
        fields["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        fields["stop_token_ids"] = list(sampling.stop_token_ids)
    return fields


def weight_version(meta: dict[str, Any]) -> int | None:
    """The weight version of a generation: the oldest of the "weight_versions" spans when the
    server reports spans ([{"version", "start", "end"}]: weights changed mid-generation; the
    oldest is what staleness is measured by), else "weight_version"; None unless it is an integer
    (vLLM's unlabelled weights are "default")."""
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans:
        versions = [int_or_none(span.get("version")) for span in spans if isinstance(span, dict)]
        if versions and all(v is not None for v in versions):
            return min(v for v in versions if v is not None)
    return int_or_none(meta.get("weight_version"))


def token_weight_versions(spans: Any, count: int) -> tuple[int, ...] | None:
    """The weight version of each of `count` generated tokens from [{"version", "start", "end"}]
    spans (tokens [start, end) sampled with `version`); None unless the spans give every token an
    integer version."""
    if not isinstance(spans, list) or not spans:
        return None
    versions: list[int | None] = [None] * count
    for span in spans:
        if not isinstance(span, dict):
            return None
        version, start, end = (
            int_or_none(span.get("version")),
            int_or_none(span.get("start")),
            int_or_none(span.get("end")),
        )
        if version is None or start is None or end is None or not 0 <= start <= end <= count:
            return None
        versions[start:end] = [version] * (end - start)
    if any(v is None for v in versions):
        return None
    return tuple(v for v in versions if v is not None)
