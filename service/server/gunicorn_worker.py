"""The gunicorn worker of a front end: uvicorn serving the front end's app, started and stopped
as the service needs.

A custom worker on gunicorn's documented base class (``gunicorn.workers.base.Worker``: gunicorn
forks it, calls ``run``, and watches its heartbeat), running ``uvicorn.Server`` on gunicorn's
sockets with the same configuration as one process serving alone
(``draining.uvicorn_config``):

- It limits request heads in size and arrival time (``http_limits``).
- It serves with ``DrainingServer``: on SIGTERM readiness turns 503 at once and the worker
  keeps serving for ``drain_delay_s`` before it closes its socket and waits for its requests.
  SIGQUIT (gunicorn's quick shutdown: its master sends it on SIGINT) stops at once. SIGHUP,
  SIGTTIN and SIGTTOU are the master's, as gunicorn documents them.
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
import sys

from fastapi import FastAPI
from gunicorn.arbiter import Arbiter
from gunicorn.workers.base import Worker
from starlette.types import Message, Receive, Scope, Send

from service.bridge.interface import EngineStatus
from service.frontend.state import FrontendState
from service.server.draining import DrainingServer, uvicorn_config

logger = logging.getLogger(__name__)

#: Period of the worker's heartbeat to gunicorn, its gauges and its check on the master.
HOUSEKEEPING_INTERVAL_S = 1.0


class BatchserveWorker(Worker):  # type: ignore[misc]
    """gunicorn worker class ``service.server.gunicorn_worker.BatchserveWorker``."""

    def init_signals(self) -> None:
        """gunicorn's handlers off: uvicorn handles SIGTERM and SIGINT, ``_serve`` SIGQUIT
        (and the event loop, not gunicorn, listens for signals); SIGUSR1 reopens the logs."""
        for each in self.SIGNALS:
            signal.signal(each, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, self.handle_usr1)
        signal.siginterrupt(signal.SIGUSR1, False)

    def run(self) -> None:
        app: FastAPI = self.wsgi
        frontend: FrontendState = app.state.frontend
        settings = frontend.settings
        # uvicorn's keep-alive is the settings' (gunicorn's own ``keepalive`` is not read).
        config = uvicorn_config(
            app,
            settings,
            forwarded_allow_ips=self.cfg.forwarded_allow_ips,
            backlog=self.cfg.backlog,
        )
        server = DrainingServer(config, frontend, settings.drain_delay_s)
        ready_gate = ReadyBeforeAccepting(app, server.stopping)
        config.app = ready_gate
        try:
            with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
                runner.run(self._serve(server, frontend))
        except SystemExit:
            # uvicorn exits with gunicorn's boot-error status when the start-up fails; a stop
            # asked for during start-up is no boot error (gunicorn would halt over it).
            if not ready_gate.stopped_before_ready:
                raise
            return
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)

    async def _serve(self, server: DrainingServer, frontend: FrontendState) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGQUIT, _quit_now, server)
        housekeeping = asyncio.create_task(self._housekeeping(frontend, server))
        try:
            # The sockets themselves, not gunicorn's wrappers of them: uvloop closes a wrapped
            # socket's descriptor behind the wrapper's back, and uvicorn's close of the wrapper
            # then logged "Error while closing socket [Errno 9]" at every shutdown.
            await server.serve(sockets=[listener.sock for listener in self.sockets])
        finally:
            housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await housekeeping

    async def _housekeeping(self, frontend: FrontendState, server: DrainingServer) -> None:
        """Tell gunicorn this worker is alive (an engine can take longer than gunicorn's
        timeout to load, and uvicorn serves nothing meanwhile), refresh the gauges, and drain
        and exit if the master has died (killed, say): an orphan would go on holding the port
        forever."""
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
