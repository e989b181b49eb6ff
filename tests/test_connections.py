"""What happens on a connection after an answer that ends its use: a real ``batchserve serve``
on 127.0.0.1 and raw sockets, so that what the server reads after answering can be seen."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.processes import (
    BATCHSERVE,
    Running,
    answers,
    batchserve_environment,
    free_port,
    running,
    wait_for,
)

pytestmark = pytest.mark.slow

MAX_BODY_BYTES = 4096
DRAIN_DELAY_S = 2.0
DIGIT = orjson.dumps({"instances": [[[0.5] * 8] * 8]})


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Running]:
    port = free_port()
    env = batchserve_environment(
        port,
        BATCHSERVE_MAX_BODY_BYTES=str(MAX_BODY_BYTES),
        BATCHSERVE_REQUEST_TIMEOUT_MS="1000",
        BATCHSERVE_DRAIN_DELAY_S=str(DRAIN_DELAY_S),
    )
    url = f"http://127.0.0.1:{port}"
    with running([str(BATCHSERVE), "serve"], url, tmp_path / "server.log", env) as process:
        wait_for(lambda: answers(url + "/readyz"), "ready", process)
        yield process


def connect(server: Running) -> socket.socket:
    port = int(server.url.rsplit(":", 1)[1])
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    return connection


def read_all(connection: socket.socket, limit_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or ``limit_s`` passes)."""
    received = b""
    deadline_s = time.monotonic() + limit_s
    while time.monotonic() < deadline_s:
        try:
            chunk = connection.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    return received


def read_response(connection: socket.socket) -> bytes:
    """One whole response (head and its Content-Length of body), and nothing more."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += connection.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += connection.recv(65536)
    assert len(body) == length, "more than one response arrived"
    return head + b"\r\n\r\n" + body


def request(body: bytes, **headers: str) -> bytes:
    lines = [b"POST /predict HTTP/1.1", b"Host: test", b"Content-Type: application/json"]
    lines += [f"{name}: {value}".encode() for name, value in headers.items()]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def test_a_413_from_content_length_closes_and_reads_no_next_request(server: Running) -> None:
    """The unread body's bytes were read as the next request on a kept-alive connection."""
    with connect(server) as connection:
        oversized = request(b'{"instances": [', **{"Content-Length": str(MAX_BODY_BYTES + 1)})
        connection.sendall(oversized + request(DIGIT, **{"Content-Length": str(len(DIGIT))}))
        answer = read_all(connection)
    assert answer.startswith(b"HTTP/1.1 413")
    assert b"connection: close" in answer.lower()
    assert answer.count(b"HTTP/1.1") == 1, "nothing after the 413 may be taken for a request"


def test_a_413_on_a_chunked_upload_stops_the_reading(server: Running) -> None:
    """The server read on for gigabytes after answering 413 to a chunked upload."""
    chunk = b"%x\r\n%s\r\n" % (65536, b"1" * 65536)
    sent = 0
    with connect(server) as connection:
        connection.sendall(request(b"", **{"Transfer-Encoding": "chunked"}))
        connection.settimeout(2.0)
        started_s = time.monotonic()
        try:
            while sent < 256 * 2**20 and time.monotonic() - started_s < 30:
                connection.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
    # What the kernel buffers on both sides, not the 256 MiB the client tried to send.
    assert sent < 32 * 2**20, f"{sent} bytes were taken after the body limit of {MAX_BODY_BYTES}"


def test_a_body_not_received_by_the_deadline_is_408_and_the_connection_closed(
    server: Running,
) -> None:
    with connect(server) as connection:
        connection.sendall(request(DIGIT[:10], **{"Content-Length": str(len(DIGIT))}))
        started_s = time.monotonic()
        answer = read_all(connection)
        waited_s = time.monotonic() - started_s
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"connection: close" in answer.lower()
    assert b'"code":"request_timeout"' in answer
    assert 0.8 < waited_s < 3.0, "answered at the 1 s request deadline"


def test_answers_while_draining_close_their_keep_alive_connection(server: Running) -> None:
    with connect(server) as connection:
        connection.sendall(request(DIGIT, **{"Content-Length": str(len(DIGIT))}))
        first = read_response(connection)
        assert first.startswith(b"HTTP/1.1 200")
        assert b"connection: close" not in first.lower()
        server.process.send_signal(signal.SIGTERM)
        # Readiness off, within the drain delay: still serving.
        wait_for(
            lambda: answers(server.url + "/readyz", 503), "draining", server, DRAIN_DELAY_S / 2
        )
        connection.sendall(request(DIGIT, **{"Content-Length": str(len(DIGIT))}))
        answer = read_all(connection)
    assert answer.startswith(b"HTTP/1.1 200"), "requests are still served while draining"
    assert b"connection: close" in answer.lower()
    assert server.process.wait(timeout=30) == 0
