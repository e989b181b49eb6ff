"""An engine process once its imports are done: serve one device until told to stop.

It loads the model, runs the batcher and the device thread, and answers every front end over
the bridge socket the supervisor names. It exits 0 after SIGTERM once every queued request is
answered; ``EXIT_LOAD_FAILED`` when the model cannot be loaded (a restart would fail the same
way); ``EXIT_STALLED`` when the model hangs, so the supervisor replaces it. Every
``engine_heartbeat_interval_s`` its event loop touches its heartbeat file, which the
supervisor watches, and sends every front end a status frame: the device thread running a
long forward does not delay either. Until its models are loaded, a thread beats too
(``starting_heartbeat.py``, started by ``process.py`` before the imports).

A standby engine (``ENGINE_STANDBY_ENV``, see ``standby_engines``) serves like any other once
the front ends send it requests; one that cannot load its models stays up in phase
``failed``, so that every front end reports why, and marks its heartbeat file for the
supervisor to start it again later: the active engine serves on.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvloop

from service import tracing
from service.bridge.interface import EngineStatus, ShadowReport, SwitchResult
from service.bridge.server import BridgeServer
from service.config import Settings
from service.engine.engine import Engine, FrameRequest, Queued
from service.engine.starting_heartbeat import StartingHeartbeat
from service.engine.traffic_tally import TalliedStreams
from service.garbage import collect_young_garbage_rarely
from service.logs import configure_logging
from service.manifest import Manifest
from service.metrics import EngineMetrics, ProcessMetrics
from service.processes import (
    ENGINE_DEVICE_ENV,
    ENGINE_GENERATION_ENV,
    ENGINE_SOCKET_ENV,
    ENGINE_STANDBY_ENV,
    EXIT_LOAD_FAILED,
    EXIT_STALLED,
    FAILED_MARK,
    READY_MARK,
)
from service.traffic_window import TrafficReport

logger = logging.getLogger(__name__)

#: How often the engine refreshes its memory gauges and checks that its supervisor is there.
HOUSEKEEPING_INTERVAL_S = 1.0


class _StartedEngine:
    """The engine as the bridge serves it: its status says when the supervisor started it
    (``generation``), which the front ends choose the active engine of a device by."""

    def __init__(self, engine: Engine, generation: int) -> None:
        self._engine = engine
        self._generation = generation
        self._status: tuple[EngineStatus, EngineStatus] | None = None

    def status(self) -> EngineStatus:
        status = self._engine.status()
        if self._status is None or self._status[0] is not status:
            self._status = (status, replace(status, generation=self._generation))
        return self._status[1]

    def enqueue_frame(
        self, requests: Sequence[FrameRequest], frontend_load: int, sink: Any
    ) -> list[Queued]:
        return self._engine.enqueue_frame(requests, frontend_load, sink)

    def frontend_left(self, sink: Any) -> None:
        self._engine.frontend_left(sink)

    def generation_of(self, model: str, version: str) -> TalliedStreams:
        return self._engine.streams_of(model, version)

    async def prepare(self, name: str, version: str) -> Manifest:
        return await self._engine.prepare(name, version)

    async def prepare_split(self, name: str, weights: dict[str, int]) -> Manifest:
        return await self._engine.prepare_split(name, weights)

    async def commit(self) -> SwitchResult:
        return await self._engine.commit()

    async def abort(self) -> None:
        await self._engine.abort()

    async def unload(self, name: str) -> str:
        return await self._engine.unload(name)

    async def start_shadow(self, name: str, version: str, percent: int) -> ShadowReport:
        return await self._engine.start_shadow(name, version, percent)

    async def shadow_report(self, name: str) -> ShadowReport:
        return await self._engine.shadow_report(name)

    async def stop_shadow(self, name: str) -> ShadowReport:
        return await self._engine.stop_shadow(name)

    async def traffic(self, name: str) -> TrafficReport:
        return await self._engine.traffic(name)


async def serve_engine(
    settings: Settings,
    socket_path: Path,
    device: str,
    starting: StartingHeartbeat,
    generation: int = 0,
    standby: bool = False,
) -> int:
    """Serve one device until SIGTERM, a failed load or a hung model; the exit status.
    ``starting``: the thread beating the heartbeat file (if any) until the models are loaded.
    ``standby``: a failed load leaves it up, failed, rather than exit (see above)."""
    loop = asyncio.get_running_loop()
    heartbeat_file = starting.path
    stop = asyncio.Event()
    exit_status = 0

    def stop_with(status: int) -> None:
        nonlocal exit_status
        exit_status = exit_status or status
        stop.set()

    def load_failed() -> None:
        starting.stop()  # the load is over: only the event loop beats from now on
        if not standby:
            stop_with(EXIT_LOAD_FAILED)
        elif heartbeat_file is not None:
            heartbeat_file.write_bytes(FAILED_MARK)

    metrics = EngineMetrics()
    process_metrics = ProcessMetrics("engine")
    engine = Engine(
        settings,
        metrics,
        device=device,
        on_load_failure=load_failed,
        on_stall=lambda: stop_with(EXIT_STALLED),
    )
    heartbeat_interval_s = settings.engine_heartbeat_interval_s
    bridge = BridgeServer(
        _StartedEngine(engine, generation), socket_path, heartbeat_interval_s=heartbeat_interval_s
    )
    engine.add_listener(bridge.status_changed)
    await bridge.start()
    engine.start()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logger.info(
        "engine_started",
        extra={
            "device": device,
            "socket": str(socket_path),
            "generation": generation,
            "standby": standby,
        },
    )
    parent = os.getppid()

    async def heartbeat() -> None:
        marked_ready = False
        while heartbeat_file is not None:
            if not marked_ready and engine.state.loaded:
                # From now on the supervisor holds it to engine_heartbeat_timeout_s; while it
                # loads, the loop may pause longer (full garbage collections) on a busy host.
                _mark_ready(heartbeat_file)
                marked_ready = True
                starting.stop()
            os.utime(heartbeat_file)
            await asyncio.sleep(heartbeat_interval_s)

    async def housekeeping() -> None:
        while True:
            process_metrics.refresh()
            engine.state.refresh_device_memory()
            if os.getppid() != parent:
                logger.warning("supervisor_gone", extra={"supervisor_pid": parent})
                stop.set()
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)

    keeping = loop.create_task(housekeeping(), name="engine-housekeeping")
    beating = loop.create_task(heartbeat(), name="engine-heartbeat")
    await stop.wait()
    starting.stop()
    keeping.cancel()
    beating.cancel()
    if exit_status == EXIT_STALLED:
        # The device thread is stuck inside the model and would block the interpreter's exit:
        # leave at once. Every front end sees the connection close and answers 503.
        logger.error("engine_exiting_with_stalled_model", extra={"device": device})
        logging.shutdown()
        os._exit(EXIT_STALLED)
    if exit_status == 0:
        # A signal sent to the whole process group reaches the engine while the front ends
        # still drain: serve them until they have gone, then drain the queue.
        left = await bridge.wait_for_frontends_to_leave(settings.shutdown_grace_s)
        if not left:
            logger.warning("frontends_still_connected_at_shutdown")
    await engine.shut_down()
    await asyncio.sleep(0)  # let the last answers be written before the sockets close
    await bridge.close()
    logger.info("engine_stopped", extra={"device": device, "exit_status": exit_status})
    return exit_status


def _mark_ready(heartbeat_file: Path) -> None:
    heartbeat_file.write_bytes(READY_MARK)


def run_engine(settings: Settings, starting: StartingHeartbeat) -> int:
    """Serve the device of this process's variables (``service/processes.py``) until stopped;
    the exit status. ``starting`` beats the heartbeat file meanwhile (``process.py``)."""
    configure_logging(settings.log_level, settings.library_log_level)
    logger.info("engine_imports_done")  # torch and the rest: a step of a restart's timeline
    # What the imports made lives as long as the process: out of the full collections that
    # loading runs before the first model serves (each walks it: 0.1 s quiet, 1 s on a busy
    # host), which would otherwise delay readiness and pause the heartbeats.
    gc.freeze()
    collect_young_garbage_rarely()
    traced = tracing.start_from_environment("engine")
    try:
        return uvloop.run(
            serve_engine(
                settings,
                Path(os.environ[ENGINE_SOCKET_ENV]),
                os.environ[ENGINE_DEVICE_ENV],
                starting,
                generation=int(os.environ.get(ENGINE_GENERATION_ENV, "0")),
                standby=os.environ.get(ENGINE_STANDBY_ENV) == "1",
            )
        )
    finally:
        if traced:
            tracing.stop()
