"""HTTP client of one engine sidecar: /generate as a stream of msgpack frames, /stats as EngineStats;
each request carries the engines' token when there is one.

Closing an :class:`EngineStream` before its end closes the connection, which aborts the engine
request (the sidecar's contract).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import httpx2
import msgpack

from engine.protocol import MSGPACK, EngineStats, GenerateRequest, OutputFrame


class EngineUnavailable(Exception):
    """The replica could not take the request (down, loading, overloaded); another one may."""

    @property
    def refused(self) -> bool:
        """The connection was refused: nothing listens on the replica's port."""
        return isinstance(self.__cause__, httpx2.ConnectError)


class EngineRejected(Exception):
    """The engine refused the request as invalid (HTTP 400)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.message = message
        self.param = param


class EngineFailed(Exception):
    """The engine failed a request it had accepted (error frame, lost connection, broken stream)."""


class EngineStream:
    """One accepted /generate response."""

    def __init__(self, response: httpx2.Response, url: str):
        self._response = response
        self._url = url
        self._unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)

    async def frames(self) -> AsyncIterator[OutputFrame]:
        try:
            async for chunk in self._response.aiter_raw():
                self._unpacker.feed(chunk)
                for wire in self._unpacker:
                    yield OutputFrame.from_wire(wire)
        except httpx2.TransportError as exc:
            raise EngineFailed(f"lost the connection to engine {self._url}: {exc!r}") from exc

    async def aclose(self) -> None:
        """Idempotent; shielded, since it also runs while the request is being cancelled."""
        with anyio.CancelScope(shield=True):
            await self._response.aclose()


def engine_transport(max_keepalive: int) -> httpx2.AsyncHTTPTransport:
    """The pooled transport the gateway shares among its engines: any number of connections,
    ``max_keepalive`` of them kept alive between requests.

    httpx2's pool, not httpx's: httpcore 1.0.9 (httpx 0.28) rescans every connection once per idle
    connection and per queued request on each request, and hands one idle connection to every request
    queued in a pass, the losers retrying (encode/httpcore#1035, never merged; fixed in httpx2). With 64
    kept-alive connections, 64 streams opened together had every response head after 0.5-1.4 s instead
    of 57-91 ms (benchmarks/results/engine_client_pool_cpu.jsonl)."""
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=max_keepalive)
    return httpx2.AsyncHTTPTransport(limits=limits)


class EngineClient:
    """Talks to one engine over a shared pooled transport (:func:`engine_transport`; the transport
    layer: the client layer's cookies, redirects and auth cost about half a millisecond per request
    and do nothing here)."""

    def __init__(self, url: str, transport: httpx2.AsyncBaseTransport, token: str | None = None,
                 connect_timeout: float = 5.0):
        self.url = url
        self._transport = transport
        self._generate_url = httpx2.URL(url + "/generate")
        self._stats_url = httpx2.URL(url + "/stats")
        self._auth = {"authorization": f"Bearer {token}"} if token is not None else {}
        self._headers = {"content-type": MSGPACK, **self._auth}
        # No read timeout: a queued request may wait long for its first frame.
        self._stream_timeout = {"connect": connect_timeout, "read": None, "write": 30.0, "pool": 30.0}

    async def open(self, request: GenerateRequest) -> EngineStream:
        """Send the request and wait for the response head; raises EngineUnavailable or EngineRejected."""
        req = httpx2.Request("POST", self._generate_url, content=request.pack(), headers=self._headers,
                             extensions={"timeout": self._stream_timeout})
        try:
            response = await self._transport.handle_async_request(req)
        except httpx2.TransportError as exc:
            raise EngineUnavailable(f"engine {self.url} unreachable: {exc!r}") from exc
        if response.status_code == 200:
            return EngineStream(response, self.url)
        try:
            body = await response.aread()
        except httpx2.TransportError:
            body = b""
        finally:
            await response.aclose()
        error = _error_of(body)
        if response.status_code == 400:
            raise EngineRejected(error.get("message", "engine rejected the request"), error.get("param"))
        raise EngineUnavailable(f"engine {self.url} answered {response.status_code}: {error.get('message', '')}")

    async def stats(self, timeout: float) -> EngineStats:
        """GET /stats; raises EngineUnavailable unless the engine is ready, ValueError (a ProtocolError
        naming the field) for a body that is not its /stats."""
        req = httpx2.Request("GET", self._stats_url, headers=self._auth, extensions={"timeout": dict.fromkeys(
            ("connect", "read", "write", "pool"), timeout)})
        try:
            response = await self._transport.handle_async_request(req)
            try:
                body = await response.aread()
            finally:
                await response.aclose()
        except httpx2.TransportError as exc:
            raise EngineUnavailable(f"engine {self.url} unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise EngineUnavailable(
                f"engine {self.url} not ready ({response.status_code}): {_error_of(body).get('message', '')}")
        return EngineStats.from_wire(json.loads(body))


def _error_of(body: bytes) -> dict:
    """The ``error`` object of an engine's JSON error body, or the body's start as the message."""
    try:
        inner = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return {"message": body[:200].decode(errors="replace")}
    return inner if isinstance(inner, dict) else {}
