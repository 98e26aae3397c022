"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

A 4xx is the client's fault: the request's one log line carries the message, never a traceback.
A 5xx is ours: that same line carries the traceback (see :mod:`gateway.middleware`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

_TYPES = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("not_found_error", None),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    431: ("invalid_request_error", "request_header_fields_too_large"),
    429: ("rate_limit_error", "too_many_requests"),
    500: ("server_error", None),
    502: ("server_error", "engine_error"),
    503: ("service_unavailable_error", "overloaded"),
}


class APIError(Exception):
    """An error answered to the client as it is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        kind, default_code = _TYPES.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
        self.type = kind
        self.code = code or default_code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), self.status, self.headers, media_type="application/json")


def overloaded(status: int, message: str, retry_after: int) -> APIError:
    return APIError(status, message, headers={"Retry-After": str(retry_after)})


def record_of(request: Request):
    return request.scope["kvgate.record"]


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    record_of(request).error = exc.message
    return exc.response()


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Routing errors from Starlette (404 unknown route, 405 wrong method) in the OpenAI shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = exc.detail
    return await handle_api_error(request, APIError(exc.status_code, message, headers=exc.headers))


async def handle_server_error(request: Request, exc: Exception) -> Response:
    record_of(request).exc = exc
    return APIError(500, "internal server error").response()
