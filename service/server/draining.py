"""``DrainingServer``: uvicorn that turns readiness off before it stops accepting connections.

Used by one process serving alone and by every front end of a server with several.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from service.config import Settings
from service.frontend.state import FrontendState
from service.server.http_limits import limited_protocol


def uvicorn_config(app: FastAPI, settings: Settings) -> uvicorn.Config:
    """uvicorn serving ``app`` in one process: our JSON logs, no access log, no ``Server``
    header, and the settings' address, shutdown grace and limits on request heads."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        http=limited_protocol(settings),
        timeout_keep_alive=settings.keep_alive_timeout_s,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM first turns readiness off for ``drain_delay_s`` while serving on.

    Then uvicorn's graceful shutdown closes the listening socket, waits for every request in
    flight, and runs the app's shutdown. The process exits 0 after a clean drain instead of
    re-raising the signal.
    """

    def __init__(self, config: uvicorn.Config, frontend: FrontendState, drain_delay_s: float):
        super().__init__(config)
        self._frontend = frontend
        self._drain_delay_s = drain_delay_s
        self._exit_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM or SIGINT (or the gunicorn worker, when its master is gone).

        As a signal handler this runs between two bytecodes of the main thread, which may be
        holding a lock just then: under gunicorn prometheus_client has one lock for every
        metric, taken on each request. So it only sets attributes and leaves the rest to the
        event loop; setting a metric here froze a worker under load until it was killed.
        """
        if self._exit_requested:
            # A second signal: stop waiting out the delay; a second Ctrl-C exits at once.
            self.force_exit = sig == signal.SIGINT and self.should_exit
            self.should_exit = True
            return
        self._exit_requested = True
        self._frontend.draining = True  # /readyz answers 503 from now on
        if self._loop is None or self._drain_delay_s <= 0:
            self.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        """On the event loop: readiness off in the metrics; stop accepting after the delay."""
        self._frontend.refresh_gauges()
        if not self.should_exit and self._loop is not None:
            self._loop.call_later(self._drain_delay_s, self.stop)

    def stop(self) -> None:
        self.should_exit = True
