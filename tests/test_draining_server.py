"""DrainingServer's SIGTERM handler, on a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import signal
import threading

import httpx
import uvicorn
from starlette.types import Receive, Scope, Send

from service.config import Settings
from service.server.draining import DrainingServer
from service.server.single import create_app
from tests.fixtures import wait_until

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
