"""The granian guarantee probes' own parts (``loadtests/http_guarantees.py``): reading an
answer off a socket, naming what a connection did, and the probe app. No granian runs here."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import httpx
import pytest

from loadtests.http_guarantees import (
    EVENTS_ENV,
    probe_app,
    read_response,
    status_line,
    wait_closed,
)


def test_a_whole_answer_is_read_by_its_content_length() -> None:
    server, client = socket.socketpair()
    with server, client:
        server.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhel")
        sender = threading.Timer(0.05, server.sendall, args=(b"lo",))
        sender.start()
        answer = read_response(client)
        sender.join()
    assert answer == b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
    assert status_line(answer) == "HTTP/1.1 200 OK"


def test_a_connection_closed_without_an_answer_is_named_so() -> None:
    server, client = socket.socketpair()
    with client:
        server.close()
        assert read_response(client) == b""
    assert status_line(b"") == "closed without an answer"


def test_a_peer_that_closes_is_told_from_one_that_stays_open() -> None:
    server, client = socket.socketpair()
    with server, client:
        assert wait_closed(client, 0.1) == (None, b"")  # still open
        server.sendall(b"bye")
        server.close()
        closed_s, sent = wait_closed(client, 5.0)
    assert closed_s is not None
    assert sent == b"bye"


async def test_the_probe_app_reports_the_client_and_records_what_receive_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv(EVENTS_ENV, str(events))
    transport = httpx.ASGITransport(app=probe_app, client=("203.0.113.7", 4321))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        seen = await client.get("/client")
        watched = await client.post("/watch?s=0.2", content=b"{}")
    assert seen.json() == {"client": ["203.0.113.7", 4321]}
    assert watched.status_code == 200
    # The client stays for its answer: receive() gives nothing while the request waits.
    assert '"got": null, "after_s": 0.2' in events.read_text()
