"""HTTP limits at the server layer, which uvicorn lacks: a time limit for a request's head and for its
body (408, then close), a size limit for the head (431, then close), and a bound on open connections.

uvicorn gives an idle keep-alive timeout (used as it is) and ``--limit-concurrency``, which answers 503
only once a request head has arrived: a connection that never finishes its head (slowloris) is never
counted, never answered and never closed, and enough of them exhaust the process's file descriptors.
:func:`limited_protocol` subclasses uvicorn's httptools protocol instead:

- a connection must send each request head within ``header_timeout`` of its start (or of its first byte
  after an idle keep-alive pause), and the body within ``body_timeout`` of the head;
- past ``max_connections`` a new connection closes the oldest one that has not sent a whole head (a slow
  or idle client holds no request); only when every connection is running a request does the new one
  get a 503. Descriptors are then never exhausted, and a slow client cannot lock out a fast one;
- malformed HTTP gets an OpenAI-shaped 400 rather than uvicorn's plain text;
- a refused connection closes the way nginx's ``lingering_close`` does: the answer, then a FIN, then what
  the client still sends is read and dropped for up to ``LINGER_S``. Closed at once with unread input,
  the socket would send a RST, which can destroy the answer before the client reads it (a 431 for a head
  still arriving reached the client as "connection reset by peer" on a loaded 2-core box).
"""

from __future__ import annotations

import json
import resource
from asyncio import TimerHandle, Transport
from typing import NamedTuple

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.errors import APIError

FD_HEADROOM = 64  # descriptors kept for engines, Redis, logs and the tokenizer's files
LINGER_S = 2.0  # how long a refused connection drops the client's input before it closes


class HttpLimits(NamedTuple):
    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    keep_alive_timeout: float
    max_connections: int


def default_max_connections() -> int:
    """Half of the descriptors left after the headroom: each running request also holds one to its engine."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft - FD_HEADROOM) // 2)


def error_bytes(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response with the OpenAI-shaped error body that closes the connection."""
    body = json.dumps(APIError(status, message).body()).encode()
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: ", str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n", body])


def limited_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits``; one class per server (its waiting list is the server's)."""

    # Connections without a whole request head, oldest first: those a new connection may close.
    waiting: dict[LimitedProtocol, None] = {}

    class LimitedProtocol(HttpToolsProtocol):
        _timer: TimerHandle | None = None
        _lingering = False  # refused: answered and half-closed, dropping input until it closes
        _in_head = False
        _head_bytes = 0  # received since the head began (an unfinished head's size)
        _head_size = 0  # of the request line and headers parsed

        def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                if waiting:
                    next(iter(waiting)).close()
                else:
                    self._refuse(503, "this server holds its limit of connections, all running requests; "
                                      "retry later")
                    return
            self._start_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timer()
            waiting.pop(self, None)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return
            if not self._in_head and (self.cycle is None or self.cycle.response_complete):
                self._start_head()  # the next request on a kept-alive connection
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > limits.max_header_bytes and not self._refused():
                self._refuse(431, f"the request head exceeds {limits.max_header_bytes} bytes")

        def on_url(self, url: bytes) -> None:
            self._head_size += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_size += len(name) + len(value) + 4  # ": " and CRLF
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            waiting.pop(self, None)
            if self._head_size > limits.max_header_bytes:  # a whole head that came in one read
                self._refuse(431, f"the request head exceeds {limits.max_header_bytes} bytes")
                return
            self._set_timer(limits.body_timeout, 408, "the request body did not arrive in time")
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused():  # the rest of the read is not a request's
                super().on_body(body)

        def on_message_complete(self) -> None:
            self._cancel_timer()
            if not self._refused():
                super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # arms uvicorn's keep-alive timeout
            waiting[self] = None  # idle: closable for a new connection

        def send_400_response(self, msg: str) -> None:
            self._refuse(400, "malformed HTTP request")

        def close(self) -> None:
            waiting.pop(self, None)
            self._cancel_timer()
            if not self.transport.is_closing():
                self.transport.close()

        def _start_head(self) -> None:
            self._in_head = True
            self._head_bytes = self._head_size = 0
            waiting[self] = None
            self._set_timer(limits.header_timeout, 408, "the request head did not arrive in time")

        def _set_timer(self, seconds: float, status: int, message: str) -> None:
            self._cancel_timer()
            self._timer = self.loop.call_later(seconds, self._refuse, status, message)

        def _cancel_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _refused(self) -> bool:
            return self._lingering or self.transport.is_closing()

        def _refuse(self, status: int, message: str) -> None:
            """Answer ``status`` unless a response has started, then close, lingering (see the module)."""
            if self._refused():
                return
            if (self.cycle is not None and self.cycle.response_started) or not self.transport.can_write_eof():
                self.close()  # a response of the app's own is being written: it ends here
                return
            self.transport.write(error_bytes(status, message))
            self.transport.write_eof()
            self._lingering = True
            waiting[self] = None  # holds no request: a new connection past the limit may close it
            self._cancel_timer()
            self._timer = self.loop.call_later(LINGER_S, self.close)

    return LimitedProtocol
