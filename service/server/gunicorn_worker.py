"""The gunicorn worker of a front end: uvicorn's worker, made to start and stop like one.

Five differences from ``uvicorn_worker.UvicornWorker``:

- It limits request heads in size and arrival time (``http_limits``).
- It serves with ``DrainingServer``: on SIGTERM readiness turns 503 at once and the worker
  keeps serving for ``drain_delay_s`` before it closes its socket and waits for its requests.
- It accepts no connection before an engine is ready: the kernel then hands connections only
  to front ends that can answer them. If every engine failed to load, it fails its start, and
  gunicorn stops instead of restarting workers that cannot serve. Told to stop before then
  (the supervisor stops when an engine cannot load the model), it exits at once: it has
  accepted nothing to drain, and waiting would only run out gunicorn's graceful timeout.
- It refreshes its gauges every second: a scrape is answered by one process, and the others'
  values would otherwise be as old as the last scrape they answered.
- It drains and exits when its master dies, instead of serving on as an orphan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send
from uvicorn_worker import UvicornWorker

from service.bridge.interface import EngineStatus
from service.frontend.state import FrontendState
from service.server.draining import DrainingServer
from service.server.http_limits import limited_protocol

logger = logging.getLogger(__name__)

#: Period of the worker's heartbeat to gunicorn, its gauges and its check on the master.
HOUSEKEEPING_INTERVAL_S = 1.0


class BatchserveWorker(UvicornWorker):  # type: ignore[misc]
    """gunicorn worker class ``service.server.gunicorn_worker.BatchserveWorker``."""

    CONFIG_KWARGS: dict[str, Any] = {
        **UvicornWorker.CONFIG_KWARGS,
        "server_header": False,
        "access_log": False,
    }

    async def _serve(self) -> None:
        app: FastAPI = self.wsgi
        frontend: FrontendState = app.state.frontend
        settings = frontend.settings
        self.config.http = limited_protocol(settings)
        self.config.timeout_graceful_shutdown = settings.shutdown_grace_s
        server = DrainingServer(self.config, frontend, settings.drain_delay_s)
        ready_gate = ReadyBeforeAccepting(app, server.stopping)
        self.config.app = ready_gate
        asyncio.get_running_loop().add_signal_handler(signal.SIGQUIT, _quit_now, server)
        housekeeping = asyncio.create_task(self._housekeeping(frontend, server))
        try:
            await server.serve(sockets=self.sockets)
        except SystemExit:
            # uvicorn exits with gunicorn's boot-error status when the start-up fails; a stop
            # asked for during start-up is no boot error (gunicorn would halt over it).
            if not ready_gate.stopped_before_ready:
                raise
        finally:
            housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await housekeeping

    async def _housekeeping(self, frontend: FrontendState, server: DrainingServer) -> None:
        """Tell gunicorn this worker is alive (uvicorn does so only once it serves, and an
        engine can take longer than gunicorn's timeout to load), refresh the gauges, and drain
        and exit if the master has died (killed, say): uvicorn workers do not check, and an
        orphan would go on holding the port forever."""
        while True:
            if os.getppid() != self.ppid:
                logger.warning("master_gone", extra={"master_pid": self.ppid, "pid": os.getpid()})
                server.handle_exit(signal.SIGTERM, None)
                return
            self.notify()
            frontend.refresh_gauges()
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)


def _quit_now(server: DrainingServer) -> None:
    """SIGQUIT, gunicorn's quick shutdown (its master sends it on SIGINT): stop without waiting
    for the drain delay, for requests in flight or for an engine still loading."""
    server.force_exit = True
    server.should_exit = True
    server.stopping.set()


class ReadyBeforeAccepting:
    """Holds back the ASGI ``lifespan.startup.complete`` until an engine is ready.

    uvicorn opens its sockets only after startup completes, so until then this worker takes no
    connection. If every engine failed to load, it reports ``lifespan.startup.failed`` instead,
    and uvicorn exits with gunicorn's boot-error status. If ``stopping`` is set first, it fails
    the start-up too and sets ``stopped_before_ready``. Every other message passes unchanged.
    """

    def __init__(self, app: FastAPI, stopping: asyncio.Event) -> None:
        self.app = app
        self.stopping = stopping
        self.stopped_before_ready = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        failed = False

        async def send_once_ready(message: Message) -> None:
            nonlocal failed
            if failed:
                # The worker is exiting and cancels the lifespan: nothing more to report.
                return
            if message["type"] == "lifespan.startup.complete":
                status = await self._loaded_or_stopping()
                if status is None:
                    failed = self.stopped_before_ready = True
                    logger.info("frontend_stopped_before_ready", extra={"pid": os.getpid()})
                    message = {
                        "type": "lifespan.startup.failed",
                        "message": "told to stop before an engine was ready",
                    }
                elif not status.ready:
                    failed = True
                    message = {
                        "type": "lifespan.startup.failed",
                        "message": f"no engine could load the model: {status.detail}",
                    }
                else:
                    logger.info("frontend_ready", extra={"pid": os.getpid()})
            await send(message)

        await self.app(scope, receive, send_once_ready)

    async def _loaded_or_stopping(self) -> EngineStatus | None:
        """The engines' status once settled, or None if told to stop first."""
        loading: asyncio.Task[EngineStatus] = self.app.state.loading
        stopping = asyncio.create_task(self.stopping.wait())
        try:
            await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        return loading.result() if loading.done() else None
