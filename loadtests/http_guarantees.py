"""Which of the front end's HTTP guarantees granian gives: quick real tries, on 127.0.0.1.

    python -m loadtests.http_guarantees [--only head_431 drain ...]

batchserve's front ends run uvicorn with ``LimitedHttpToolsProtocol`` (``service/server/
http_limits.py``) under ``DrainingServer`` (``service/server/draining.py``) and
``BatchserveWorker``; the tests in ``tests/`` hold each guarantee there. This program starts
granian (ASGI, one worker) with ``probe_app`` for each probe, does what a client (or an
orchestrator's SIGTERM) would, and prints what granian did, one line per probe:

- ``head_431``: a request whose headers exceed 32 KiB (our ``max_header_bytes``), with
  granian's default buffer and with ``--http1-buffer-size 32768``;
- ``head_timeout``: half a request head, then silence, and a connection that sends nothing,
  with ``--http1-header-read-timeout 2000`` (HTTP/1 and 2 detected, and ``--http 1``): when
  granian closes, and what it answers;
- ``keep_alive_idle``: a kept-alive connection left idle after its answer: when granian closes
  it (default settings, and with the header-read timeout of 2 s);
- ``disconnect``: the app awaits ``receive()`` after the body while the request waits (as our
  ``DisconnectWatcher`` does): is ``http.disconnect`` delivered when the client leaves, and is
  nothing delivered while it stays;
- ``drain``: SIGTERM while a 2 s request is in flight: is it answered; is a new connection
  accepted; is a kept-alive connection's next request answered; when lifespan shutdown runs;
- ``lifespan``: a start-up of 3 s (are connections accepted before it completes) and a failed
  one (does granian exit, with what status);
- ``proxy``: ``X-Forwarded-For`` from 127.0.0.1: what ``scope["client"]`` the app sees;
- ``max_body``: batchserve's front end (the ceiling app) under granian with
  ``max_body_bytes`` 64 KiB, sent 160 kB with a ``Content-Length`` and chunked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from loadtests import http_servers, servers

EVENTS_ENV = "HTTP_PROBE_EVENTS"
STARTUP_S_ENV = "HTTP_PROBE_STARTUP_S"
STARTUP_FAIL_ENV = "HTTP_PROBE_STARTUP_FAIL"
HEAD_LIMIT_BYTES = 32 * 1024
_OK = b'{"ok":true}'


def _event(kind: str, **fields: object) -> None:
    """Append one event, time-stamped on the monotonic clock the processes share."""
    path = os.environ.get(EVENTS_ENV)
    if path:
        with open(path, "a") as events:
            events.write(json.dumps({"event": kind, "at_s": time.monotonic(), **fields}) + "\n")


async def _answer(send: Any, body: bytes = _OK, status: int = 200) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await asyncio.sleep(float(os.environ.get(STARTUP_S_ENV, "0")))
            if os.environ.get(STARTUP_FAIL_ENV):
                await send({"type": "lifespan.startup.failed", "message": "probe: failed"})
                return
            _event("startup_complete")
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            _event("shutdown")
            await send({"type": "lifespan.shutdown.complete"})
            return


async def probe_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``/client``: the client address the app sees; ``/slow?s=N``: answered after N s;
    ``/watch?s=N``: after the body, waits N s (2) on ``receive()`` and records what came;
    else 200."""
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    more_body = True
    while more_body:
        message = await receive()
        more_body = message.get("more_body", False)
    path = scope["path"]
    if path == "/client":
        await _answer(send, json.dumps({"client": scope.get("client")}).encode())
    elif path == "/slow":
        seconds = float(scope["query_string"].decode().partition("=")[2] or "2")
        _event("slow_started")
        await asyncio.sleep(seconds)
        _event("slow_answered")
        await _answer(send)
    elif path == "/watch":
        seconds = float(scope["query_string"].decode().partition("=")[2] or "2")
        started = time.monotonic()
        try:
            message = await asyncio.wait_for(receive(), seconds)
            _event("watch", got=message["type"], after_s=round(time.monotonic() - started, 2))
        except TimeoutError:
            _event("watch", got=None, after_s=seconds)
        await _answer(send)
    else:
        await _answer(send)


class Granian:
    """granian serving ``probe_app`` on a free port, its events in a file of their own."""

    def __init__(
        self,
        folder: Path,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        target: str = "loadtests.http_guarantees:probe_app",
    ):
        self.port = servers.free_port()
        self.events = folder / f"events-{self.port}.jsonl"
        self.log = folder / f"granian-{self.port}.log"
        command = [
            part.format(port=self.port)
            for part in http_servers.granian_command(target, factory=False, extra=extra)
        ]
        full_env = dict(os.environ) | {EVENTS_ENV: str(self.events)} | (env or {})
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, env=full_env, stdout=log, stderr=log)

    def wait_ready(self, timeout_s: float = 30.0, path: str = "/") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"granian exited {self.process.returncode}")
            with contextlib.suppress(OSError), self.connect() as connection:
                connection.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                if read_head(connection).startswith(b"HTTP/1.1 200"):
                    return
            time.sleep(0.1)
        raise RuntimeError("granian did not answer within 30 s")

    def connect(self, timeout_s: float = 10.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s)

    def read_events(self) -> list[dict[str, Any]]:
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines()]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@contextlib.contextmanager
def granian(folder: Path, extra: Sequence[str] = (), ready: bool = True) -> Iterator[Granian]:
    server = Granian(folder, extra)
    try:
        if ready:
            server.wait_ready()
        yield server
    finally:
        server.stop()


def read_head(connection: socket.socket) -> bytes:
    """What arrives up to the end of a response head, or until the peer closes."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = connection.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


def read_response(connection: socket.socket) -> bytes:
    """A whole response with a ``content-length`` (or what came before the peer closed)."""
    received = read_head(connection)
    head, _, body = received.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = connection.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body if head else b""


def status_line(data: bytes) -> str:
    """The first line of an answer, or what the connection did instead."""
    if not data:
        return "closed without an answer"
    return data.split(b"\r\n", 1)[0].decode(errors="replace")


def wait_closed(connection: socket.socket, limit_s: float) -> tuple[float | None, bytes]:
    """Seconds until the peer closes (None if still open after ``limit_s``), and what it sent."""
    connection.settimeout(limit_s)
    started = time.monotonic()
    received = b""
    try:
        while True:
            chunk = connection.recv(65536)
            if not chunk:
                return time.monotonic() - started, received
            received += chunk
    except TimeoutError:
        return None, received
    except ConnectionResetError:
        return time.monotonic() - started, received


def _request(path: str, body: bytes = b"", extra_headers: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra_headers}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def probe_head_431(folder: Path) -> list[str]:
    big = "x-big: " + "a" * (HEAD_LIMIT_BYTES + 8 * 1024) + "\r\n"
    lines = []
    for label, extra in (
        ("default buffer", []),
        ("--http1-buffer-size 32768", ["--http1-buffer-size", "32768"]),
    ):
        with granian(folder, extra) as server, server.connect() as connection:
            connection.sendall(_request("/", extra_headers=big))
            lines.append(f"head of 40 KiB, {label}: {status_line(read_head(connection))}")
    return lines


def probe_head_timeout(folder: Path) -> list[str]:
    lines = []
    timeout = ["--http1-header-read-timeout", "2000"]
    for label, extra in (("--http auto", timeout), ("--http 1", [*timeout, "--http", "1"])):
        with granian(folder, extra) as server:
            with server.connect() as connection:
                connection.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                closed_s, sent = wait_closed(connection, 8.0)
                lines.append(f"half a head, timeout 2 s, {label}: {_closing(closed_s, sent)}")
            with server.connect() as connection:
                closed_s, sent = wait_closed(connection, 8.0)
                lines.append(
                    f"connected, nothing sent, timeout 2 s, {label}: {_closing(closed_s, sent)}"
                )
    return lines


def _closing(closed_s: float | None, sent: bytes) -> str:
    if closed_s is None:
        return f"still open after the wait ({status_line(sent) if sent else 'nothing sent'})"
    answer = status_line(sent) if sent else "no answer"
    return f"closed after {closed_s:.1f} s, {answer}"


def probe_keep_alive_idle(folder: Path) -> list[str]:
    lines = []
    for label, extra in (
        ("default", []),
        ("header-read timeout 2 s", ["--http1-header-read-timeout", "2000"]),
    ):
        with granian(folder, extra) as server, server.connect() as connection:
            connection.sendall(_request("/"))
            first = status_line(read_response(connection))
            closed_s, sent = wait_closed(connection, 12.0)
            lines.append(f"idle after an answer ({first}), {label}: {_closing(closed_s, sent)}")
    return lines


def probe_disconnect(folder: Path) -> list[str]:
    with granian(folder) as server:
        with server.connect() as connection:
            connection.sendall(_request("/watch", b"{}"))
            time.sleep(0.3)
        time.sleep(2.5)
        with server.connect() as connection:
            connection.sendall(_request("/watch", b"{}"))
            answer = status_line(read_response(connection))
        watches = [event for event in server.read_events() if event["event"] == "watch"]
    lines = []
    for label, watch in zip(("client left after 0.3 s", "client stayed"), watches, strict=False):
        got = watch["got"] or "nothing"
        lines.append(f"receive() after the body, {label}: {got} after {watch['after_s']} s")
    lines.append(f"the client that stayed was answered: {answer}")
    return lines


def probe_drain(folder: Path) -> list[str]:
    lines = []
    with granian(folder) as server:
        idle = server.connect()
        idle.sendall(_request("/"))
        read_response(idle)
        slow = server.connect()
        slow.sendall(_request("/slow?s=2"))
        time.sleep(0.5)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        try:
            with server.connect(timeout_s=3.0) as fresh:
                fresh.sendall(_request("/"))
                lines.append(
                    f"new connection 0.2 s after SIGTERM: {status_line(read_response(fresh))}"
                )
        except OSError as error:
            lines.append(f"new connection 0.2 s after SIGTERM: {type(error).__name__} ({error})")
        try:
            idle.sendall(_request("/"))
            lines.append(
                f"kept-alive connection, request after SIGTERM: {status_line(read_response(idle))}"
            )
        except OSError as error:
            lines.append(f"kept-alive connection, request after SIGTERM: {type(error).__name__}")
        idle.close()
        answer = status_line(read_response(slow))
        slow.close()
        lines.append(f"request in flight at SIGTERM (2 s): {answer}")
        try:
            status = server.process.wait(timeout=30)
            lines.append(
                f"granian exited {status}, {time.monotonic() - signalled:.1f} s after SIGTERM"
            )
        except subprocess.TimeoutExpired:
            lines.append("granian still running 30 s after SIGTERM")
        events = {event["event"]: event["at_s"] - signalled for event in server.read_events()}
        order = ", ".join(
            f"{name} {at_s:+.2f} s" for name, at_s in sorted(events.items(), key=lambda kv: kv[1])
        )
        lines.append(f"app events relative to SIGTERM: {order}")
    return lines


def probe_lifespan(folder: Path) -> list[str]:
    lines = []
    server = Granian(folder, env={STARTUP_S_ENV: "3"})
    try:
        time.sleep(1.5)
        try:
            with server.connect(timeout_s=5.0) as connection:
                connection.sendall(_request("/"))
                started = time.monotonic()
                answer = status_line(read_response(connection))
                lines.append(
                    f"start-up of 3 s, connection at 1.5 s: accepted; answered {answer} "
                    f"{time.monotonic() - started:.1f} s later"
                )
        except OSError as error:
            lines.append(f"start-up of 3 s, connection at 1.5 s: {type(error).__name__} ({error})")
    finally:
        server.stop()
    failing = Granian(folder, env={STARTUP_FAIL_ENV: "1"})
    try:
        status = failing.process.wait(timeout=20)
        lines.append(f"lifespan.startup.failed: granian exited {status}")
    except subprocess.TimeoutExpired:
        lines.append("lifespan.startup.failed: granian still running after 20 s")
    finally:
        failing.stop()
    return lines


def probe_proxy(folder: Path) -> list[str]:
    with granian(folder) as server, server.connect() as connection:
        connection.sendall(_request("/client", extra_headers="X-Forwarded-For: 203.0.113.7\r\n"))
        body = read_response(connection).partition(b"\r\n\r\n")[2]
    return [f"X-Forwarded-For: 203.0.113.7 from 127.0.0.1, scope client: {body.decode()}"]


def probe_max_body(folder: Path) -> list[str]:
    """batchserve's front end (the ceiling app) under granian, ``max_body_bytes`` 64 KiB."""
    from loadtests import configs

    repository = configs.MLP_MODEL.package(folder / "package")
    env = {
        "BATCHSERVE_MODEL_REPOSITORY": str(repository),
        "BATCHSERVE_MODEL_NAME": configs.MLP_MODEL.name,
        "BATCHSERVE_MAX_BODY_BYTES": str(64 * 1024),
        "BATCHSERVE_LOG_LEVEL": "warning",
        "PROMETHEUS_MULTIPROC_DIR": str(folder),
    }
    target = "service.server.tuning.ceiling:create_app_from_environment"
    server = Granian(folder, ["--factory"], env=env, target=target)
    lines = []
    try:
        server.wait_ready(path="/readyz")
        body = b"[" + b"0.5," * 40_000 + b"0.5]"
        json_type = "Content-Type: application/json\r\n"
        with server.connect() as connection:
            connection.sendall(_request("/predict", body, json_type))
            answer = read_response(connection)
            lines.append(f"body of {len(body)} bytes with a length: {status_line(answer)}")
        with server.connect() as connection:
            head = "POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            connection.sendall((head + json_type + "\r\n").encode())
            for start in range(0, len(body), 16384):
                chunk = body[start : start + 16384]
                connection.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            connection.sendall(b"0\r\n\r\n")
            answer = read_response(connection)
            lines.append(f"the same body chunked, no length: {status_line(answer)}")
    finally:
        server.stop()
    return lines


PROBES: dict[str, Callable[[Path], list[str]]] = {
    "head_431": probe_head_431,
    "head_timeout": probe_head_timeout,
    "keep_alive_idle": probe_keep_alive_idle,
    "disconnect": probe_disconnect,
    "drain": probe_drain,
    "lifespan": probe_lifespan,
    "proxy": probe_proxy,
    "max_body": probe_max_body,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=list(PROBES), default=list(PROBES))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="http-guarantees-") as folder:
        for name in args.only:
            for line in PROBES[name](Path(folder)):
                print(f"{name}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
