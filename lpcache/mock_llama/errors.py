"""llama-server's error envelope: ``{"error": {"code", "message", "type"}}``."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def error_response(status: int, message: str, type_: str | None = None, **extra: Any) -> Response:
    """An error in the real server's shape; the type follows the status unless given."""
    body = {"code": status, "message": message, "type": type_ or ERROR_TYPES.get(status, "server_error")}
    body.update(extra)
    return json_response({"error": body}, status)
