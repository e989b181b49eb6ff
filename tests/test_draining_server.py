"""DrainingServer's SIGTERM handler, on a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from pathlib import Path

import httpx
import uvicorn
from starlette.types import Receive, Scope, Send

from service.config import Settings
from service.server.draining import DrainingServer
from service.server.single import create_app
from tests.fixtures import wait_until
from tests.processes import (
    BATCHSERVE,
    answers,
    batchserve_environment,
    free_port,
    running,
    wait_for,
)

DRAIN_DELAY_S = 0.3


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


async def test_the_sigterm_handler_waits_on_no_lock_the_interrupted_code_may_hold() -> None:
    """A signal handler runs between two bytecodes of the main thread, which may hold a lock
    just then: under gunicorn one prometheus_client lock guards every metric and is taken on
    each request. A handler that set a metric would wait on it forever (a worker froze under
    load that way). Here the event loop's thread holds the readiness gauge's lock while the
    handler runs; the handler must return at once, and the drain must still happen."""
    frontend = create_app(Settings(device="cpu")).state.frontend  # its engine never starts
    frontend.metrics.ready.set(1)
    config = uvicorn.Config(hello, host="127.0.0.1", port=0, log_config=None, lifespan="off")
    server = DrainingServer(config, frontend, DRAIN_DELAY_S)
    serving = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]

    lock = frontend.metrics.ready._value._lock  # the lock a metric update holds
    handler = threading.Thread(target=server.handle_exit, args=(signal.SIGTERM, None))
    with lock:
        handler.start()
        handler.join(timeout=2.0)
        returned = not handler.is_alive()
    handler.join()
    assert returned, "handle_exit waited on a metric's lock"
    assert frontend.draining

    # Still serving during the drain delay, with readiness off; then it stops by itself.
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/")
    assert response.status_code == 200
    await asyncio.sleep(0)
    assert frontend.metrics.ready._value.get() == 0
    assert not serving.done()
    await asyncio.wait_for(serving, timeout=10.0)
    assert server.should_exit


def answer_status(client: socket.socket) -> str:
    """The status line's code the server answered on ``client``, or how it failed."""
    received = b""
    try:
        while chunk := client.recv(65536):
            received += chunk
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "no answer"
    finally:
        client.close()
    return received.split(b" ", 2)[1].decode() if received else "closed unanswered"


def test_sigterm_answers_the_connections_waiting_in_the_accept_backlog(tmp_path: Path) -> None:
    """Connections the kernel accepted and the server had not (it was stopped, here with
    SIGSTOP) when SIGTERM came are answered, not reset by closing the listening socket."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = batchserve_environment(port, BATCHSERVE_DRAIN_DELAY_S="0")
    with running([str(BATCHSERVE), "serve"], url, tmp_path / "server.log", env) as server:
        wait_for(lambda: answers(url + "/readyz"), "ready", server)
        server.process.send_signal(signal.SIGSTOP)
        try:
            clients = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(32)]
            for client in clients:
                client.sendall(b"GET /healthz HTTP/1.1\r\nHost: batchserve\r\n\r\n")
            server.process.send_signal(signal.SIGTERM)
        finally:
            server.process.send_signal(signal.SIGCONT)
        statuses = [answer_status(client) for client in clients]
        assert server.process.wait(timeout=30) == 0, server.output()
    assert statuses == ["200"] * len(clients)
