"""Pure-ASGI middleware: request context (id, log line) and Bearer-key authentication."""

from __future__ import annotations

import hashlib
import hmac
import re
import time
import uuid
from dataclasses import dataclass

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import KeyRing

log = structlog.get_logger("gateway")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass(slots=True)
class RequestRecord:
    """What the request's one log line says; filled in by the middleware and the handlers."""

    request_id: str
    arrival: float  # time.perf_counter() when the request came in
    tenant: str | None = None
    status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    replica: str | None = None
    route: str | None = None  # why that replica: the routing reason (of each choice, for n > 1)
    predicted_cached_tokens: int | None = None
    finish_reason: str | None = None
    ttft_ms: float | None = None
    error: str | None = None
    exc: BaseException | None = None


def route_path(scope: Scope) -> str:
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class RequestContextMiddleware:
    """Accepts or makes the X-Request-Id, echoes it, binds it into every log line of the request, and
    writes the request's one log line at the end. Catches what escaped the app so that uvicorn never
    logs a second traceback."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        given = _header(scope, b"x-request-id")
        request_id = given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        record = RequestRecord(request_id, start)
        scope["kvgate.record"] = record
        id_header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message["headers"] = [*message.get("headers", ()), id_header]
            await send(message)

        tokens = structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            record.exc = record.exc or exc
            if record.status is None:  # it escaped before any answer (Starlette answers what it catches)
                await APIError(500, "internal server error").response()(scope, receive, send_with_id)
        finally:
            self._log(scope, record, start)
            structlog.contextvars.reset_contextvars(**tokens)

    def _log(self, scope: Scope, record: RequestRecord, start: float) -> None:
        path = route_path(scope)
        status = record.status if record.status is not None else 499  # client left before an answer
        seconds = time.perf_counter() - start
        self.metrics.observe_request(path, status, seconds)
        fields = {
            "method": scope["method"], "path": path, "status": status, "latency_ms": round(seconds * 1e3, 2),
            "client": scope["client"][0] if scope.get("client") else None,
        }
        for name in ("tenant", "prompt_tokens", "completion_tokens", "cached_tokens", "replica", "route",
                     "predicted_cached_tokens", "finish_reason", "ttft_ms", "error"):
            value = getattr(record, name)
            if value is not None:
                fields[name] = value
        if record.exc is not None:
            log.error("request", exc_info=record.exc, **fields)
        elif path in OPEN_PATHS:
            log.debug("request", **fields)  # probes would drown the request lines; the pool logs state changes
        elif status in (429, 503):
            log.warning("request", **fields)  # overload: expected under load, no fault of ours
        elif status >= 500:
            log.error("request", **fields)
        else:
            log.info("request", **fields)


class SaltKey:
    """A tenant's cache salt: HMAC(the engines' secret, tenant id). The tenant id is in every log line;
    without the secret it gives no salt, so reading logs does not let anyone address a tenant's cache."""

    def __init__(self, secret: str | None):
        # without a secret the engines listen on loopback only (they refuse otherwise)
        self._key = (secret or "").encode()

    def salt(self, tenant: str | None) -> str | None:
        if tenant is None:
            return None
        return hmac.new(self._key, b"kvgate-salt:" + tenant.encode(), hashlib.sha256).hexdigest()[:32]


class AuthMiddleware:
    """Bearer-key check in constant time over all keys (:class:`gateway.ratelimit.KeyRing`); the key's id
    becomes the request's tenant, and the key (with its limits) ``scope["kvgate.key"]``.

    Open without a key: /health, /ready, /metrics and every OPTIONS request. With no keys configured
    every path is open and requests have no tenant.
    """

    def __init__(self, app: ASGIApp, keys: KeyRing):
        self.app = app
        self._keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._keys or scope["method"] == "OPTIONS" or route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        key = self._keys.lookup(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        if key is None:
            message = "missing API key: send 'Authorization: Bearer <key>'" if not auth else "invalid API key"
            scope["kvgate.record"].error = message
            await APIError(401, message, headers={"WWW-Authenticate": "Bearer"}).response()(scope, receive, send)
            return
        scope["kvgate.record"].tenant = key.tenant
        scope["kvgate.key"] = key
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
