"""HTTP limits at the server layer, against a real gateway process: slow and oversized request heads,
slow bodies, idle keep-alive connections, malformed HTTP, and a slowloris crowd at the descriptor limit."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from gw_harness import API_KEYS, Proc, start_gateway

HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
KEEP_ALIVE = 1.0
EARLY = 0.01  # libuv's timers count whole milliseconds from the clock it cached at the loop's last turn
MAX_HEADER_BYTES = 8192
MAX_OPEN_FILES = 256
AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}


@pytest.fixture(scope="module")
def limited_gateway(dummy_engine, tmp_path_factory) -> Iterator[Proc]:
    gw = start_gateway(
        tmp_path_factory.mktemp("limits") / "gateway.log", "--engine", dummy_engine.url, "--api-key", API_KEYS[0],
        "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
        "--keep-alive-timeout", str(KEEP_ALIVE), "--max-header-bytes", str(MAX_HEADER_BYTES),
        max_open_files=MAX_OPEN_FILES,
    )
    yield gw
    gw.stop()


def connect(gw: Proc) -> socket.socket:
    parts = urlsplit(gw.url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    return sock


def read_response(sock: socket.socket) -> tuple[int | None, dict | None]:
    """(status, JSON body) of the one response before the server closes; (None, None) if it closed silently."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    if not data:
        return None, None
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_slow_head_gets_408_and_is_closed(limited_gateway):
    start = time.monotonic()  # before connecting: the server's head clock starts when it accepts
    sock = connect(limited_gateway)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # never finished
    status, body = read_response(sock)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert HEADER_TIMEOUT - EARLY <= time.monotonic() - start < HEADER_TIMEOUT + 5


def test_a_connection_that_sends_nothing_is_closed(limited_gateway):
    sock = connect(limited_gateway)
    assert read_response(sock)[0] == 408


def test_an_oversized_head_gets_431(limited_gateway):
    for headers in ([b"X-Big: " + b"a" * (MAX_HEADER_BYTES + 10)],  # one read, or an unfinished one
                    [b"X-Big-%d: %s" % (i, b"a" * 1000) for i in range(50)]):
        sock = connect(limited_gateway)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"\r\n".join(headers) + b"\r\n")
        status, body = read_response(sock)
        assert status == 431 and body["error"]["code"] == "request_header_fields_too_large"


def test_a_slow_body_gets_408(limited_gateway):
    sock = connect(limited_gateway)
    start = time.monotonic()  # before the head goes out: the server's body clock starts when it arrives
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEYS[0].encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    status, body = read_response(sock)
    assert status == 408 and "body" in body["error"]["message"]
    assert BODY_TIMEOUT - EARLY <= time.monotonic() - start < BODY_TIMEOUT + 5
    time.sleep(0.5)  # the request's log line: a 408, no traceback
    assert "Traceback" not in limited_gateway.log_path.read_text()


def test_malformed_http_gets_an_openai_shaped_400(limited_gateway):
    sock = connect(limited_gateway)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nBad Header Without Colon\r\n\r\n")
    status, body = read_response(sock)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_idle_keep_alive_connections_are_closed(limited_gateway):
    sock = connect(limited_gateway)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    response = http.client.HTTPResponse(sock)  # the head and the whole body, however many reads they take
    response.begin()
    assert response.status == 200 and response.read()
    start = time.monotonic()
    assert sock.recv(65536) == b""  # closed by the server, with nothing more
    assert time.monotonic() - start < KEEP_ALIVE + 3


def test_slowloris_crowd_at_the_descriptor_limit_does_not_lock_out_clients(limited_gateway):
    """300 connections that dribble their heads, against 256 descriptors: a real client still gets in,
    and every slow one is closed by the header timeout (or earlier, to make room)."""
    slow = []
    for _ in range(300):
        sock = connect(limited_gateway)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        slow.append(sock)
    served = 0
    with httpx.Client(base_url=limited_gateway.url, headers=AUTH) as client:
        for _ in range(10):
            try:
                served += client.get("/v1/models", timeout=2.0).status_code == 200
            except httpx.TransportError:
                pass
            for sock in slow:  # keep dribbling
                try:
                    sock.send(b"X")
                except OSError:
                    pass
    print(f"served {served} of 10 within 2 s beside 300 slow connections")
    assert served >= 9
    for sock in slow:  # each closed within the header timeout of its start: recv times out otherwise
        sock.settimeout(HEADER_TIMEOUT + 5)
        try:
            while sock.recv(65536):
                pass
        except ConnectionResetError:
            pass  # closed by the server while our bytes were unread: closed all the same
        sock.close()
    assert httpx.get(limited_gateway.url + "/health").status_code == 200
