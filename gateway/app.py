"""The gateway ASGI application: routes, middleware stack, and the lifespan that owns every client.

Stack, outermost first: proxy headers (trusted proxies only) → request context (X-Request-Id, the
request's log line) → auth → Starlette (routes, OpenAI-shaped error handlers).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import structlog
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic.json_schema import models_json_schema
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from engine.protocol import EXCLUSIVE_MINIMUM, FLOAT_BOUNDS, INT_BOUNDS
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.engine_client import engine_transport
from gateway.errors import APIError, handle_api_error, handle_http_exception, handle_server_error
from gateway.metrics import GatewayMetrics
from gateway.middleware import AuthMiddleware, RequestContextMiddleware, SaltKey
from gateway.openai_responses import ResponsesRequest
from gateway.pool import EnginePool
from gateway.ratelimit import KeyRing, RateLimiter, open_buckets
from gateway.response_store import ResponseStore, make_response_store
from gateway.router import make_router
from gateway.schemas import UNSUPPORTED_NOTE, ChatCompletionRequest, CompletionRequest
from gateway.serving import Serving
from gateway.spawn import EngineProcesses
from gateway.tokenize_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from gateway.tokenizer import Tokenizer, load_hf_tokenizer
from gateway.workers import WorkerPool

log = structlog.get_logger("gateway")
VERSION = importlib.metadata.version("kvgate")


# The value bounds the document states (the engine's, from engine.protocol; the context bounds max_tokens).
VALUE_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    **FLOAT_BOUNDS, **INT_BOUNDS, "top_logprobs": INT_BOUNDS["logprobs"], "best_of": INT_BOUNDS["n"],
    "prompt_logprobs": INT_BOUNDS["logprobs"], "max_tokens": (1, None), "max_completion_tokens": (1, None),
    "min_tokens": (0, None),
}


def _state_bounds(properties: dict[str, Any]) -> None:
    """Write VALUE_BOUNDS into the numeric schema (or union member) of each bounded property."""
    for name, (lo, hi) in VALUE_BOUNDS.items():
        prop = properties.get(name)
        if prop is None:
            continue
        for schema in prop.get("anyOf", [prop]):
            if schema.get("type") in ("integer", "number"):
                if lo is not None:
                    schema["exclusiveMinimum" if name in EXCLUSIVE_MINIMUM else "minimum"] = lo
                if hi is not None:
                    schema["maximum"] = hi


def openapi_schema(model_name: str) -> dict[str, Any]:
    """OpenAPI 3.1 document generated from the request models, with the value bounds the server enforces
    and the one model it serves."""
    _, defs = models_json_schema(
        [(m, "validation") for m in (ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeRequest,
                                     DetokenizeRequest)],
        ref_template="#/components/schemas/{model}",
    )
    for model in ("ChatCompletionRequest", "CompletionRequest"):
        properties = defs["$defs"][model]["properties"]
        _state_bounds(properties)
        properties["model"]["anyOf"][0]["enum"] = [model_name]
        for name, prop in properties.items():
            if UNSUPPORTED_NOTE in prop.get("description", ""):  # accepted as null (or one value, described)
                properties[name] = {"type": "null", "description": prop["description"]}
    error = {"description": "OpenAI-shaped error", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"error": {"type": "object", "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}}}}

    def generation(model: str, summary: str, answer: str = "JSON, or text/event-stream chunks when stream is true"
                   ) -> dict:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model}"}}}},
            "responses": {
                "200": {"description": answer},
                **{str(s): error for s in (400, 401, 404, 408, 413, 415, 429, 431, 502, 503)},
            },
        }}

    return {
        "openapi": "3.1.0",
        "info": {"title": "kvgate", "version": "0.1.0"},
        "components": {"schemas": defs["$defs"],
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": generation("ChatCompletionRequest", "Chat completion"),
            "/v1/completions": generation("CompletionRequest", "Text completion"),
            "/v1/responses": generation("ResponsesRequest", "Responses API (stateless unless store)",
                                        "JSON, or text/event-stream events when stream is true"),
            "/tokenize": generation("TokenizeRequest", "A prompt or chat messages to token ids", "token ids"),
            "/detokenize": generation("DetokenizeRequest", "Token ids to text", "text"),
            "/version": {"get": {"summary": "kvgate's version", "responses": {
                "200": {"description": "version"}, "401": error}}},
            "/v1/models": {"get": {"summary": "Served models", "responses": {
                "200": {"description": "model list"}, "401": error}}},
            "/v1/models/{model_id}": {"get": {
                "summary": "One served model", "parameters": [{"name": "model_id", "in": "path", "required": True,
                                                               "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model"}, "401": error, "404": error}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {
                "200": {"description": "OpenAPI 3.1"}, "401": error}}},
            "/health": {"get": {"summary": "Liveness (open)", "security": [],
                                "responses": {"200": {"description": "alive"}}}},
            "/ready": {"get": {"summary": "Readiness: some engine replica is ready (open)", "security": [],
                               "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (open)", "security": [],
                                 "responses": {"200": {"description": "text exposition format"}}}},
        },
    }


EXCEPTION_HANDLERS = {APIError: handle_api_error, HTTPException: handle_http_exception, Exception: handle_server_error}


def middleware_stack(app: ASGIApp, config: GatewayConfig, metrics: GatewayMetrics) -> ASGIApp:
    keys = KeyRing(config.api_keys, config.api_key_file, config.key_limits)
    stack: ASGIApp = RequestContextMiddleware(AuthMiddleware(app, keys), metrics)
    if config.trusted_proxies:
        stack = ProxyHeadersMiddleware(stack, trusted_hosts=list(config.trusted_proxies))
    return stack


def _lifespan(config: GatewayConfig, metrics: GatewayMetrics) -> Callable[[Starlette], AbstractAsyncContextManager]:
    """The lifespan that starts and stops every client; its state (``request.state``) holds what handlers use."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        # Spawned engines get a fresh secret unless one is given: it also keys the tenants' cache salts.
        engine_token = config.engine_token or (secrets.token_hex(32) if config.spawn is not None else None)
        procs = EngineProcesses(config.spawn, engine_token) if config.spawn is not None else None
        workers = WorkerPool(config.render_threads, config.render_queue, config.render_timeout)
        buckets = open_buckets(config.rate_limit_url)
        # One connection pool for all engines; --max-in-flight bounds the connections, and kept-alive
        # ones spare the hot path a TCP handshake.
        transport = engine_transport(min(config.max_in_flight, 256))
        router = make_router(config, metrics)  # started once the engines' model is known
        health: asyncio.Task | None = None
        response_store: ResponseStore | None = None
        router_started = False
        try:
            urls = list(config.engines) if procs is None else await procs.start()
            hf = await asyncio.to_thread(load_hf_tokenizer, config.tokenizer, config.cache_dir)
            tokenizer = Tokenizer(hf, config.tokenizer_cache_mb << 20, chat_template=config.chat_template)
            pool = EnginePool(urls, transport, metrics, engine_token=engine_token, dns=config.engine_dns)
            model = await pool.wait_ready(config.engine_startup_timeout, require_all=procs is not None,
                                          check_alive=procs.check_alive if procs is not None else lambda: None)
            if tokenizer.vocab_size > model.limits.vocab_size:
                raise RuntimeError(f"the tokenizer {config.tokenizer} has {tokenizer.vocab_size} tokens but the "
                                   f"engines' model only {model.limits.vocab_size}: wrong --tokenizer?")
            await router.start(model.name, model.block_size)
            router_started = True
            name = model.name  # the engines own the served name (spawned ones were given --served-model-name)
            response_store = make_response_store(config.index_url, config.response_ttl)
            serving = Serving(config, tokenizer, Dispatcher(pool, router, metrics), model, name, metrics,
                              response_store, workers, SaltKey(engine_token), RateLimiter(buckets))
            health = asyncio.create_task(pool.run_health_checks(config.health_interval))
            log.info("gateway_ready", model=name, replicas=[r.url for r in pool.replicas],
                     max_model_len=model.limits.max_model_len, routing=config.routing,
                     auth=bool(config.api_keys or config.api_key_file),
                     tenant_isolation=not config.shared_prefix_cache)
            if not (config.api_keys or config.api_key_file):
                log.warning("auth_disabled", reason="no --api-key, --api-key-file or API_KEYS: the API is open")
            yield {"serving": serving, "pool": pool, "metrics": metrics, "openapi": openapi_schema(name),
                   "started": int(time.time())}
        finally:
            workers.close()
            await buckets.close()
            if health is not None:
                health.cancel()
            if router_started:
                await router.close()
            if response_store is not None:
                await response_store.close()
            await transport.aclose()
            if procs is not None:
                await procs.stop()

    return lifespan


async def chat(request: Request) -> Response:
    return await request.state.serving.chat(request)


async def completions(request: Request) -> Response:
    return await request.state.serving.completions(request)


async def responses(request: Request) -> Response:
    return await request.state.serving.responses(request)


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


def _model_card(request: Request) -> dict[str, Any]:
    serving: Serving = request.state.serving
    return {"id": serving.model_name, "object": "model", "created": request.state.started, "owned_by": "kvgate",
            "root": serving.model_name, "max_model_len": serving.model.limits.max_model_len}


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


async def model(request: Request) -> Response:
    card = _model_card(request)
    if request.path_params["model_id"] != card["id"]:
        raise APIError(404, f"the model {request.path_params['model_id']!r} does not exist; this server serves "
                            f"{card['id']!r}", param="model", code="model_not_found")
    return JSONResponse(card)


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    pool: EnginePool = request.state.pool
    replicas = {r.url: "ready" if r.ready else r.error for r in pool.replicas}
    ok = bool(pool.ready_replicas())
    return JSONResponse({"status": "ready" if ok else "not_ready", "replicas": replicas}, 200 if ok else 503)


async def prometheus(request: Request) -> Response:
    request.state.pool.export_metrics()
    return Response(request.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def openapi_json(request: Request) -> Response:
    return JSONResponse(request.state.openapi)


def create_app(config: GatewayConfig) -> ASGIApp:
    metrics = GatewayMetrics()
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/version", version, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/openapi.json", openapi_json, methods=["GET"]),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=_lifespan(config, metrics),
    )
    return middleware_stack(app, config, metrics)
