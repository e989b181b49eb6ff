"""``DrainingServer``: uvicorn that turns readiness off before it stops accepting connections.

Used by one process serving alone and by every front end of a server with several.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from service.config import Settings
from service.frontend.loop_lag import watch_loop_lag
from service.frontend.state import FrontendState
from service.garbage import collect_young_garbage_rarely
from service.server.http_limits import HeadLimitedProtocol, limited_protocol


def uvicorn_config(
    app: ASGIApp,
    settings: Settings,
    *,
    forwarded_allow_ips: list[str] | str | None = None,
    backlog: int = 2048,
) -> uvicorn.Config:
    """uvicorn serving ``app``, alone or as a gunicorn worker: our JSON logs, no access log, no
    ``Server`` header, and the settings' address, keep-alive, shutdown grace and limits on
    request heads. A gunicorn worker passes gunicorn's ``forwarded_allow_ips`` and
    ``backlog``."""
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
        forwarded_allow_ips=forwarded_allow_ips,
        backlog=backlog,
    )


#: At shutdown, how long connections that have not sent a request yet are given to send it.
FIRST_REQUEST_WAIT_S = 1.0
FIRST_REQUEST_POLL_S = 0.01


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
        #: ``_exit_requested``, seen on the event loop (the signal handler may not touch it):
        #: set once SIGTERM or SIGINT has arrived; what waits for the app's
        #: start-up (an engine to load) stops waiting, as there is nothing to drain yet.
        self.stopping = asyncio.Event()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        collect_young_garbage_rarely()
        lag = asyncio.create_task(watch_loop_lag(self._frontend.metrics.loop_lag))
        try:
            await super().serve(sockets)
        finally:
            lag.cancel()

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
        self.stopping.set()
        self._frontend.refresh_gauges()
        if not self.should_exit and self._loop is not None:
            self._loop.call_later(self._drain_delay_s, self.stop)

    def stop(self) -> None:
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, after answering the connections still in the listening
        socket's accept backlog. Closing that socket would reset them (2 to 26 of them in a
        burst); under gunicorn the socket is shared with the other workers, which go on
        accepting from it, so only a socket of this process's own is drained."""
        if sockets is None:
            await self._answer_the_backlog()
        await super().shutdown(sockets)

    async def _answer_the_backlog(self) -> None:
        loop = asyncio.get_running_loop()
        accepted = take_backlog(self.servers)
        for connection in accepted:
            await loop.connect_accepted_socket(self._new_protocol, connection)
        # uvicorn's shutdown closes every connection that has not begun a request: give
        # those whose requests are still on their way a moment (polled: shutdown only).
        protocol = self.config.http_protocol_class
        if not (isinstance(protocol, type) and issubclass(protocol, HeadLimitedProtocol)):
            return
        for _ in range(round(FIRST_REQUEST_WAIT_S / FIRST_REQUEST_POLL_S)):
            if not any(c.awaiting_first_request for c in protocol.open_connections):
                break
            await asyncio.sleep(FIRST_REQUEST_POLL_S)

    def _new_protocol(self) -> asyncio.Protocol:
        """A connection's protocol, as uvicorn's ``startup`` builds it."""
        protocol: asyncio.Protocol = self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )
        return protocol


def take_backlog(servers: list[asyncio.base_events.Server]) -> list[socket.socket]:
    """Stop ``servers`` accepting, then take the connections waiting in their listening
    sockets' backlogs: the sockets are duplicated first, so closing the servers leaves them
    listening until every waiting connection is taken."""
    listeners = [
        socket.fromfd(sock.fileno(), sock.family, sock.type)
        for server in servers
        for sock in server.sockets
    ]
    for server in servers:
        server.close()
    accepted = []
    try:
        for listener in listeners:
            listener.setblocking(False)
            while True:
                try:
                    connection, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                accepted.append(connection)
    finally:
        for listener in listeners:
            listener.close()  # nothing awaited since the last accept: no connection lost
    return accepted
