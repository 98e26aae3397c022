"""The middleware stack in process: one log line per request, a traceback only for real faults, request
ids, proxy headers from trusted proxies only."""

from __future__ import annotations

import httpx
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.app import EXCEPTION_HANDLERS, middleware_stack
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics


async def boom(request: Request):
    raise RuntimeError("a bug")


async def bad(request: Request):
    raise APIError(400, "n must be >= 1", param="n")


async def who(request: Request):
    return JSONResponse({"client": request.client.host, "scheme": request.url.scheme})


def client(config: GatewayConfig, peer: str = "127.0.0.1") -> httpx.AsyncClient:
    app = Starlette(routes=[Route("/boom", boom), Route("/bad", bad), Route("/who", who)],
                    exception_handlers=EXCEPTION_HANDLERS)
    stack = middleware_stack(app, config, GatewayMetrics())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=stack, client=(peer, 1234)), base_url="http://gw")


async def test_a_fault_is_one_error_line_with_its_traceback():
    with structlog.testing.capture_logs() as logs:
        async with client(GatewayConfig()) as c:
            resp = await c.get("/boom", headers={"X-Request-Id": "fault-1"})
    assert resp.status_code == 500 and resp.headers["x-request-id"] == "fault-1"
    assert resp.json() == {"error": {"message": "internal server error", "type": "server_error", "param": None,
                                     "code": None}}
    (line,) = logs
    assert line["event"] == "request" and line["log_level"] == "error" and line["status"] == 500
    assert isinstance(line["exc_info"], RuntimeError)


async def test_a_client_error_is_one_info_line_without_traceback():
    with structlog.testing.capture_logs() as logs:
        async with client(GatewayConfig()) as c:
            resp = await c.get("/bad")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
    (line,) = logs
    assert line["log_level"] == "info" and line["error"] == "n must be >= 1" and "exc_info" not in line
    assert len(resp.headers["x-request-id"]) == 32  # none given: one is made


async def test_a_malformed_request_id_is_replaced():
    async with client(GatewayConfig()) as c:
        resp = await c.get("/bad", headers={"X-Request-Id": "bad id\twith spaces"})
    assert resp.headers["x-request-id"] != "bad id\twith spaces" and len(resp.headers["x-request-id"]) == 32


async def test_forwarded_headers_only_from_trusted_proxies():
    headers = {"X-Forwarded-For": "203.0.113.7", "X-Forwarded-Proto": "https"}
    async with client(GatewayConfig(trusted_proxies=("10.0.0.0/8",)), peer="10.1.2.3") as c:
        assert (await c.get("/who", headers=headers)).json() == {"client": "203.0.113.7", "scheme": "https"}
    async with client(GatewayConfig(trusted_proxies=("10.0.0.0/8",)), peer="192.0.2.1") as c:
        assert (await c.get("/who", headers=headers)).json() == {"client": "192.0.2.1", "scheme": "http"}
    async with client(GatewayConfig(), peer="10.1.2.3") as c:  # no trusted proxies: headers ignored
        assert (await c.get("/who", headers=headers)).json() == {"client": "10.1.2.3", "scheme": "http"}


async def test_keys_checked_before_anything_else():
    async with client(GatewayConfig(api_keys=("sk-1",))) as c:
        assert (await c.get("/boom")).status_code == 401
        assert (await c.get("/boom", headers={"Authorization": "Bearer sk-1"})).status_code == 500
