"""What a gateway call can fail with, each error carrying the HTTP status and the OpenAI-shaped
`type`/`code` the harness gets (never a 500 for the caller's mistake). Each API writes the same
error in its own shape: `body()` OpenAI's, `anthropic_body()` Anthropic's."""

from __future__ import annotations

# Anthropic's error type per status (its API has no type of its own for 409: a conflict with
# the recorded history is the request's fault).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
}


class GatewayError(Exception):
    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def body(self) -> dict[str, object]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, object]:
        """Anthropic's shape: {"type": "error", "error": {"type", "message"}}; the code, where
        there is one, leads the message (Anthropic's shape has no field for it)."""
        message = f"{self.code}: {self}" if self.code else str(self)
        error_type = _ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": error_type, "message": message}}


class RequestError(GatewayError):
    """The request is malformed; the message says what and where."""


class UnknownKey(GatewayError):
    status = 401
    code = "invalid_api_key"

    def __init__(self) -> None:
        super().__init__("unknown or closed gateway key (pass the rollout's key as the Bearer token or in /r/<key>/v1)")


class ContextLengthExceeded(GatewayError):
    """The prompt leaves no room for a single generated token under the sample's length limit."""

    code = "context_length_exceeded"


class MaxTurnsExceeded(GatewayError):
    """The rollout already made its max_calls generation calls."""

    code = "max_turns_exceeded"


class HistoryRewritten(GatewayError):
    """The conversation does not extend the previous call's, under the FAIL policy."""

    status = 409
    code = "history_rewritten"


class Unavailable(GatewayError):
    """No LLM server could generate (or one aborted the request)."""

    status = 503
    type = "server_error"
    code = "llm_unavailable"
