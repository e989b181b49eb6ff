"""The gunicorn worker: uvicorn's worker, made to start and stop like ``batchserve serve``.

Five differences from ``uvicorn_worker.UvicornWorker``:

- It serves with ``DrainingServer``: on SIGTERM readiness turns 503 at once and the worker
  keeps serving for ``drain_delay_s`` before it closes its socket and drains the batcher.
- It accepts no connection before its model is ready: the kernel then hands connections only
  to workers that can answer them, so a worker that is (re)starting never answers 503. A model
  that fails to load fails the worker's start, and gunicorn stops instead of restarting
  workers that cannot load it.
- It refreshes its memory gauges every second: under gunicorn a scrape is answered by one
  worker, and the others' values would otherwise be as old as the last scrape they answered.
- It drains and exits when its master dies, instead of serving on as an orphan.
- It follows admin version switches made through its siblings (``version_sync.py``).
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

from service import lifecycle, version_sync
from service.cli import EXIT_STALLED, DrainingServer
from service.errors import ConflictError
from service.gunicorn_setup import worker_shutdown_s
from service.state import ServiceState

logger = logging.getLogger(__name__)

#: Period of the worker's heartbeat to gunicorn, its memory gauges and its check on the master.
HOUSEKEEPING_INTERVAL_S = 1.0


class BatchserveWorker(UvicornWorker):  # type: ignore[misc]
    """gunicorn worker class ``service.gunicorn_worker.BatchserveWorker``."""

    CONFIG_KWARGS: dict[str, Any] = {
        **UvicornWorker.CONFIG_KWARGS,
        "server_header": False,
        "access_log": False,
    }

    async def _serve(self) -> None:
        app: FastAPI = self.wsgi
        service: ServiceState = app.state.service
        self.config.app = ReadyBeforeAccepting(app)
        self.config.timeout_graceful_shutdown = worker_shutdown_s(service.settings)
        server = DrainingServer(self.config, service, service.settings.drain_delay_s)
        # A hung model (a batch outlived stall_timeout_s): stop serving; see below.
        service.on_stall = server.stop
        asyncio.get_running_loop().add_signal_handler(signal.SIGQUIT, _quit_now, server)
        housekeeping = asyncio.create_task(self._housekeeping(service, server))
        try:
            await server.serve(sockets=self.sockets)
        finally:
            housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await housekeeping
        if service.stalled:
            # The device thread is stuck inside the model and would block the interpreter's
            # exit: leave at once, and gunicorn's master starts a fresh worker in our place.
            logger.error("worker_exiting_with_stalled_model", extra={"pid": os.getpid()})
            logging.shutdown()
            os._exit(EXIT_STALLED)

    async def _housekeeping(self, service: ServiceState, server: DrainingServer) -> None:
        """Tell gunicorn this worker is alive (uvicorn does so only once it serves, and loading
        a model can take longer than gunicorn's timeout), refresh the memory gauges, follow a
        version another worker published, and drain and exit if the master has died (killed,
        say): uvicorn workers do not check, and an orphan would go on holding the port and its
        share of memory forever."""
        follower = PublishedVersionFollower(service)
        try:
            while True:
                if os.getppid() != self.ppid:
                    logger.warning(
                        "master_gone", extra={"master_pid": self.ppid, "pid": os.getpid()}
                    )
                    server.handle_exit(signal.SIGTERM, None)
                    return
                self.notify()
                service.refresh_memory_gauges()
                follower.check()
                await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
        finally:
            await follower.stop()


class PublishedVersionFollower:
    """Switches this worker to the version another worker published after an admin switch.

    The switch (load, verify, warm up) runs in a task of its own, so the heartbeat to gunicorn
    goes on meanwhile. A version this worker failed to load is not retried until another one is
    published: the worker keeps serving what it has, and says so in its log.
    """

    def __init__(self, service: ServiceState) -> None:
        self._service = service
        self._switching: asyncio.Task[None] | None = None
        self._refused: version_sync.PublishedVersion | None = None

    def check(self) -> None:
        if self._switching is not None and not self._switching.done():
            return
        service = self._service
        if service.switch_lock.locked() or service.draining or service.stalled:
            return  # an admin switch is under way here, or the worker is going away
        published = version_sync.read_published()
        current = service.manifest
        if published is None or current is None:
            return
        if (current.name, current.version) == (published.name, published.version):
            return
        if published == self._refused:
            return
        self._switching = asyncio.create_task(self._switch(published))

    async def _switch(self, published: version_sync.PublishedVersion) -> None:
        try:
            await lifecycle.switch_version(self._service, published.name, published.version)
        except ConflictError:
            return  # an admin switch began here meanwhile; look again at the next check
        except Exception as error:  # refused (422), gone from the repository, or worse
            self._refused = published
            logger.error(
                "published_version_refused",
                extra={"model": published.name, "version": published.version, "error": str(error)},
            )

    async def stop(self) -> None:
        if self._switching is not None:
            self._switching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._switching


def _quit_now(server: DrainingServer) -> None:
    """SIGQUIT, gunicorn's quick shutdown (its master sends it on SIGINT): stop without waiting
    for the drain delay or for requests in flight."""
    server.force_exit = True
    server.should_exit = True


class ReadyBeforeAccepting:
    """Holds back the ASGI ``lifespan.startup.complete`` until the model has loaded.

    uvicorn opens its sockets only after startup completes, so until then this worker takes no
    connection. If the model failed to load, it reports ``lifespan.startup.failed`` instead,
    and uvicorn exits with gunicorn's boot-error status. Every other message passes unchanged.
    """

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        failed = False

        async def send_once_loaded(message: Message) -> None:
            nonlocal failed
            if failed:
                # The worker is exiting and cancels the lifespan: nothing more to report.
                return
            if message["type"] == "lifespan.startup.complete":
                # The loading task records its own failure; it never raises.
                await self.app.state.loading
                error = self.app.state.service.load_error
                if error is not None:
                    failed = True
                    message = {
                        "type": "lifespan.startup.failed",
                        "message": f"the model failed to load: {error}",
                    }
            await send(message)

        await self.app(scope, receive, send_once_loaded)
