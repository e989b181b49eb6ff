"""The engine of ``batchserve predict`` in a process of its own, reached over the bridge.

With the engine in the same process, the device thread shared one interpreter lock with the
feeder and the event loop: each of the model's operators lets the lock go while it computes
and then waits to take it back from whichever thread reads, parses or writes rows. Here the
engine runs as ``batchserve serve --workers N`` runs it (``service.engine.process``, one per
device, the same settings), and this process, a front end without HTTP, reads, prepares and
writes: the forward shares its interpreter only with the engine's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from service.bridge.client import BridgeClient
from service.config import Settings
from service.errors import ModelLoadError
from service.frontend.state import FrontendState
from service.processes import (
    ENGINE_DEVICE_ENV,
    ENGINE_GENERATION_ENV,
    ENGINE_INDEX_ENV,
    ENGINE_SOCKET_ENV,
    ENGINE_STANDBY_ENV,
    RUN_DIR_ENV,
)
from service.server.child_processes import die_with_parent
from service.server.devices import count_cuda_devices, engine_devices
from service.server.launcher import settings_environment
from service.server.supervisor import engine_command

#: This process's standard error, where the engines' logs go (its ``sys.stderr`` may be a
#: stream without a file descriptor of its own).
STDERR_FD = 2
#: How long an engine asked to stop may take to drain before it is killed.
STOP_GRACE_S = 10.0


class EngineExitedError(Exception):
    """An engine process ended during the run (``status``: its exit status), or its
    connection was lost and it did not end (None)."""

    def __init__(self, status: int | None) -> None:
        self.status = status
        if status is None:
            super().__init__("the engine process stopped answering")
        elif status < 0:
            super().__init__(f"the engine process was killed ({signal.Signals(-status).name})")
        else:
            super().__init__(f"the engine process stopped (exit status {status})")


@dataclass
class EngineProcesses:
    """The front end's state over the engines, and a task per engine that ends when its
    process exits (with its status)."""

    frontend: FrontendState
    exits: list[asyncio.Task[int]]

    def exit_status(self) -> int | None:
        """The exit status of an engine that has ended, None while all run."""
        return next((exit.result() for exit in self.exits if exit.done()), None)

    async def exit_status_within(self, seconds: float) -> int | None:
        """``exit_status`` once an engine ends, or after ``seconds`` (None: all still run)."""
        await asyncio.wait(self.exits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        return self.exit_status()


@contextlib.asynccontextmanager
async def engine_processes(
    settings: Settings, overrides: Mapping[str, object]
) -> AsyncIterator[EngineProcesses]:
    """An engine process per device serving the models of ``settings`` (``overrides``: the
    command's own settings, passed on as ``BATCHSERVE_*`` variables), connected once one is
    ready; stopped on exit. ``ModelLoadError`` when the model cannot be loaded."""
    run_dir = Path(tempfile.mkdtemp(prefix="batchserve-predict-"))
    environ = dict(os.environ) | settings_environment(overrides) | {RUN_DIR_ENV: str(run_dir)}
    devices = engine_devices(settings.device, count_cuda_devices)
    sockets = [(run_dir / f"engine-{index}.sock", device) for index, device in enumerate(devices)]
    processes: list[asyncio.subprocess.Process] = []
    client = BridgeClient(
        sockets,
        heartbeat_timeout_s=2 * settings.engine_heartbeat_timeout_s,
        request_timeout_ms=settings.request_timeout_ms,
    )
    try:
        for index, (socket, device) in enumerate(sockets):
            variables = {
                ENGINE_SOCKET_ENV: str(socket),
                ENGINE_DEVICE_ENV: device,
                ENGINE_INDEX_ENV: str(index),
                ENGINE_GENERATION_ENV: str(index),
                ENGINE_STANDBY_ENV: "0",
            }
            processes.append(
                await asyncio.create_subprocess_exec(
                    *engine_command(),
                    env=environ | variables,
                    preexec_fn=die_with_parent,
                    stdin=asyncio.subprocess.DEVNULL,
                    # Its log on this command's stderr: stdout may be the output itself.
                    stdout=STDERR_FD,
                    # Its own session: a terminal's Ctrl-C interrupts the run here, which then
                    # stops the engine (SIGTERM), rather than killing both at once.
                    start_new_session=True,
                )
            )
        exits = [asyncio.create_task(process.wait()) for process in processes]
        await client.start()
        settled = asyncio.create_task(client.wait_until_settled())
        await asyncio.wait([settled, *exits], return_when=asyncio.FIRST_COMPLETED)
        if not settled.done():
            settled.cancel()
            raise ModelLoadError(
                "the engine process exited before it served the model (its log above says why)"
            )
        status = settled.result()
        if not status.ready:
            raise ModelLoadError(status.detail or "the model cannot be served")
        frontend = FrontendState.over(client, settings)
        yield EngineProcesses(frontend, exits)
    finally:
        await client.close()
        await _stop(processes)
        shutil.rmtree(run_dir, ignore_errors=True)


async def _stop(processes: list[asyncio.subprocess.Process]) -> None:
    """SIGTERM (an engine drains what it still holds, nothing here), then SIGKILL after
    ``STOP_GRACE_S``."""
    for process in processes:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE_S)
        except TimeoutError:
            process.kill()
            await process.wait()
