"""The front end's start-up gate (``ReadyBeforeAccepting``), driven as uvicorn drives it."""

from __future__ import annotations

import asyncio
import signal

import uvicorn
from fastapi import FastAPI
from starlette.types import Message

from service.bridge.interface import EngineStatus
from service.config import Settings
from service.server.draining import DrainingServer
from service.server.gunicorn_worker import ReadyBeforeAccepting, _quit_now
from service.server.single import create_app


async def start_up(gate: ReadyBeforeAccepting) -> list[Message]:
    """What the gate sends uvicorn for ``lifespan.startup`` (then the lifespan is cancelled)."""
    sent: list[Message] = []
    answered = asyncio.Event()
    received = iter([{"type": "lifespan.startup"}])

    async def receive() -> Message:
        message = next(received, None)
        if message is None:
            await asyncio.Event().wait()  # no shutdown in these tests
        assert message is not None
        return message

    async def send(message: Message) -> None:
        sent.append(message)
        answered.set()

    lifespan = asyncio.create_task(gate({"type": "lifespan"}, receive, send))
    await asyncio.wait_for(answered.wait(), timeout=10.0)
    lifespan.cancel()
    await asyncio.gather(lifespan, return_exceptions=True)
    return sent


def app_loading(loading: asyncio.Future[EngineStatus]) -> FastAPI:
    app = FastAPI()
    app.state.loading = loading
    return app


async def test_a_stop_while_the_engine_loads_fails_the_start_up_at_once() -> None:
    """The supervisor stops gunicorn when an engine cannot load its model, before any engine
    was ready: the front end has accepted nothing and must not wait for an engine (it waited
    out gunicorn's graceful timeout, 20 s, before it was killed)."""
    stopping = asyncio.Event()
    gate = ReadyBeforeAccepting(app_loading(asyncio.Future()), stopping)
    stopping.set()
    sent = await start_up(gate)
    assert [message["type"] for message in sent] == ["lifespan.startup.failed"]
    assert "stop" in sent[0]["message"]
    assert gate.stopped_before_ready


async def test_every_engine_failed_fails_the_start_up_as_no_stop() -> None:
    loading: asyncio.Future[EngineStatus] = asyncio.Future()
    loading.set_result(EngineStatus(phase="failed", detail="no model named 'nosuchmodel'"))
    gate = ReadyBeforeAccepting(app_loading(loading), asyncio.Event())
    sent = await start_up(gate)
    assert [message["type"] for message in sent] == ["lifespan.startup.failed"]
    assert "nosuchmodel" in sent[0]["message"]
    assert not gate.stopped_before_ready


def test_sigterm_and_a_quick_shutdown_both_end_the_wait_for_an_engine() -> None:
    app = create_app(Settings(device="cpu"))  # its engine never starts
    for stop in ("SIGTERM", "SIGQUIT"):
        server = DrainingServer(uvicorn.Config(app), app.state.frontend, drain_delay_s=5.0)
        if stop == "SIGTERM":
            asyncio.run(_sigterm(server))
        else:
            _quit_now(server)
        assert server.stopping.is_set(), stop


async def _sigterm(server: DrainingServer) -> None:
    server._loop = asyncio.get_running_loop()  # as serve() sets it
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.sleep(0)  # the drain begins on the loop
