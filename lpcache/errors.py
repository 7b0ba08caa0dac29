"""The errors lpcache raises, each able to become an OpenAI-shaped response.

One shallow tree: `ConfigError` stops start-up; `ProxyError` and its few children become
`{"error": {"message", "type", "code"}}` with an HTTP status. Errors from aiohttp or the OS are
translated into these where they enter (in `llama`), with the original chained.
"""

from __future__ import annotations

from typing import Any

import orjson


class LpcacheError(Exception):
    """Base of every error lpcache raises on purpose."""


class ConfigError(LpcacheError):
    """A bad setting: names the variable and says what is wrong. Start-up stops with exit status 2."""

    def __init__(self, variable: str, problem: str) -> None:
        super().__init__(f"{variable}: {problem}")
        self.variable = variable
        self.problem = problem


class ClientGone(LpcacheError):
    """The client disconnected before its answer started: there is nobody to answer."""


class ClientGoneReading(ClientGone):
    """The client disconnected while its request body was read: nothing was started for it, and its record is not
    told yet."""


class SharedStoreDown(LpcacheError):
    """The shared store (Redis) did not answer in time or refused the call. One type for every such failure, with
    the redis-py or OS error chained, so that callers decide one thing: go on with local decisions, or stop."""


class ProxyError(LpcacheError):
    """An error answered to the client in OpenAI's shape."""

    status = 500
    type = "server_error"

    retry_after: float | None = None   # seconds: a `Retry-After` header goes with the answer

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 code: str | int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retry_after is not None:
            self.retry_after = retry_after
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.code = code if code is not None else self.status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}

    def payload(self) -> tuple[bytes, str]:
        """The response body and its content type."""
        return orjson.dumps(self.body()), "application/json"


class BadRequest(ProxyError):
    """The client's request is malformed (400, or 422 for a body that is not JSON)."""

    status = 400
    type = "invalid_request_error"


class SlotsBusy(ProxyError):
    """No slot became free within the acquire timeout, or the wait the line predicts would pass the request's
    deadline (`admission`): 503 with Retry-After."""

    status = 503
    type = "unavailable_error"


class QueueFull(ProxyError):
    """QUEUE_MAX requests wait for a slot already (`admission`): 429 with Retry-After."""

    status = 429
    type = "rate_limit_error"


class BackendUnreachable(ProxyError):
    """The backend could not be reached, or dropped the connection."""

    status = 502
    type = "backend_unreachable"


class BackendError(ProxyError):
    """The backend answered with an error status of its own. When its answer was read (`raw`), it goes to the
    client as it is, status, body and content type: llama-server's fields beyond OpenAI's (`n_ctx`,
    `n_prompt_tokens`, which agents trim their context by) must survive."""

    type = "backend_error"

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 code: str | int | None = None, raw: bytes | None = None, content_type: str | None = None,
                 server: str | None = None) -> None:
        super().__init__(message, status=status, type=type, code=code)
        self.raw = raw
        self.content_type = content_type or "application/json"
        self.server = server   # the answer's Server header: what answered, when it is not llama-server

    def body(self) -> dict[str, Any]:
        if self.raw is not None:
            try:
                doc = orjson.loads(self.raw)
            except orjson.JSONDecodeError:
                doc = None
            if isinstance(doc, dict):
                return doc
        return super().body()

    def payload(self) -> tuple[bytes, str]:
        if self.raw is not None:
            return self.raw, self.content_type
        return super().payload()


class PluginError(LpcacheError):
    """A plugin spec that cannot be used: unknown name, bad parameter. Stops start-up with exit status 2."""
