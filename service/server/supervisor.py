"""The supervisor: ``batchserve serve`` with front ends and engine processes.

It starts one engine process per device (plus ``standby_engines`` standbys beside each), then
gunicorn with ``workers`` front ends, and watches them all without importing torch (the rules:
``docs/architecture.md``):

- An engine that exits is started again at once (after a growing back-off if it keeps dying
  young); one whose heartbeat file stays untouched too long (loaded, or still starting) is
  killed and started again; one that cannot load its model (``EXIT_LOAD_FAILED``) stops the
  server, as a restart would fail the same way; a standby that cannot load stays up, failed,
  and is started again ``STANDBY_RETRY_S`` later.
- gunicorn replaces front ends that die; if gunicorn itself exits, the server stops.
- SIGTERM: the front ends drain first, then the engines. SIGINT stops the front ends without
  draining. SIGHUP, SIGTTIN and SIGTTOU go to gunicorn.

Every child gets SIGTERM if the supervisor dies, so none is left serving as an orphan.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import orjson
from prometheus_client import multiprocess

from service.config import Settings
from service.metrics import MULTIPROCESS_DIR_ENV
from service.processes import (
    ENGINE_DEVICE_ENV,
    ENGINE_GENERATION_ENV,
    ENGINE_HEARTBEAT_FILE_ENV,
    ENGINE_INDEX_ENV,
    ENGINE_SOCKET_ENV,
    ENGINE_STANDBY_ENV,
    ENGINES_ENV,
    EXIT_LOAD_FAILED,
    FAILED_MARK,
    READY_MARK,
    RUN_DIR_ENV,
)
from service.server.child_processes import (
    backoff_s,
    die_with_parent,
    sleep_until_woken,
    wake_on_signals,
)
from service.server.devices import count_cuda_devices, engine_devices
from service.server.gunicorn_setup import APP_FACTORY, graceful_timeout_s
from service.server.launcher import prepare_multiprocess_dir, settings_environment
from service.server.spare_engine import SpareEngine

logger = logging.getLogger(__name__)

GUNICORN_CONFIG = "python:service.server.gunicorn_conf"
#: The longest the supervisor sleeps between looks at its children (heartbeats, gunicorn);
#: a child's exit or a signal wakes it sooner.
POLL_INTERVAL_S = 0.1
#: An engine that dies sooner than this after its start is restarted after a growing wait,
#: from its second such death in a row on: the first is restarted at once.
STABLE_AFTER_S = 30.0
FIRST_BACKOFF_S = 0.5
LONGEST_BACKOFF_S = 30.0
#: How long a standby that could not load its models stays failed before it is started again.
STANDBY_RETRY_S = 30.0


def gunicorn_command(app_factory: str = APP_FACTORY) -> list[str]:
    """The front ends' command (with the settings in the environment)."""
    return [sys.executable, "-m", "gunicorn", "--config", GUNICORN_CONFIG, app_factory]


def engine_command() -> list[str]:
    return [sys.executable, "-m", "service.engine.process"]


@dataclass
class EngineProcess:
    """One engine: its device, its socket and heartbeat file, and its current process.
    ``slot`` 0 is the engine a device starts with, the others its standbys; after a failover
    any slot may hold the active engine."""

    index: int
    device: str
    socket: Path
    heartbeat_file: Path
    slot: int = 0
    process: subprocess.Popen[bytes] | None = None
    generation: int = -1
    started_s: float = 0.0
    young_deaths: int = 0
    restart_at_s: float | None = None
    starts: int = field(default=0)

    def start(
        self,
        environ: Mapping[str, str],
        generation: int,
        standby: bool,
        spare: SpareEngine,
    ) -> None:
        """Start a process, the ``spare`` if alive; ``generation`` orders it among every engine
        started (the front ends prefer the oldest ready one); ``standby``: another is up."""
        self._forget_heartbeat()
        variables = {
            ENGINE_SOCKET_ENV: str(self.socket),
            ENGINE_DEVICE_ENV: self.device,
            ENGINE_HEARTBEAT_FILE_ENV: str(self.heartbeat_file),
            ENGINE_INDEX_ENV: str(self.index),
            ENGINE_GENERATION_ENV: str(generation),
            ENGINE_STANDBY_ENV: "1" if standby else "0",
        }
        process = spare.take(variables)
        if process is None:
            self._forget_heartbeat()  # a spare killed as it was taken may have touched it
            process = subprocess.Popen(
                engine_command(), env={**environ, **variables}, preexec_fn=die_with_parent
            )
        self.process = process
        self.started_s = time.monotonic()
        self.restart_at_s = None
        self.starts += 1
        self.generation = generation
        logger.info(
            "engine_process_started",
            extra={
                "engine": self.index,
                "slot": self.slot,
                "device": self.device,
                "pid": self.process.pid,
                "generation": generation,
                "standby": standby,
            },
        )

    def _forget_heartbeat(self) -> None:
        self.heartbeat_file.write_bytes(b"")  # not ready until the engine says so
        os.utime(self.heartbeat_file, (0, 0))  # never touched: quiet since its start

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def mark(self) -> bytes:
        """What the engine wrote in its heartbeat file: ``READY_MARK``, ``FAILED_MARK`` or
        nothing yet."""
        try:
            return self.heartbeat_file.read_bytes()
        except OSError:
            return b""

    def quiet_for_s(self) -> float:
        """Seconds since the engine last touched its heartbeat file, or since its start if it
        never has (the file's time is the wall clock's; the start's, the monotonic one's)."""
        since_start_s = time.monotonic() - self.started_s
        try:
            touched_s = self.heartbeat_file.stat().st_mtime
        except OSError:
            return since_start_s
        return min(since_start_s, time.time() - touched_s)

    def longest_quiet_s(self, settings: Settings) -> float:
        """How long this engine may go without a heartbeat before it is declared hung: the
        heartbeat timeout once it has loaded its models, the start's before."""
        if self.mark() == READY_MARK:
            return settings.engine_heartbeat_timeout_s
        return settings.engine_start_heartbeat_timeout_s


class Supervisor:
    """Runs and watches the engines and gunicorn until told to stop."""

    def __init__(self, settings: Settings, environ: dict[str, str], engines: list[EngineProcess]):
        self._settings = settings
        self._environ = environ
        self._engines = engines
        self._gunicorn: subprocess.Popen[bytes] | None = None
        self._stop_signal: int | None = None
        self._stopping = False
        self._exit_status = 0
        self._generations = itertools.count()
        self._spare = SpareEngine(
            environ,
            enabled=settings.spare_engine,
            answer_timeout_s=settings.engine_heartbeat_timeout_s,
        )

    def run(self) -> int:
        woken = wake_on_signals()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_stop_signal)
        for signum in (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU):
            signal.signal(signum, self._forward_to_gunicorn)
        for engine in self._engines:
            self._start(engine, standby=engine.slot > 0)
        self._gunicorn = subprocess.Popen(
            gunicorn_command(), env=self._environ, preexec_fn=die_with_parent
        )
        logger.info(
            "supervisor_started",
            extra={
                "workers": self._settings.workers,
                "engines": [engine.device for engine in self._engines],
                "gunicorn_pid": self._gunicorn.pid,
            },
        )
        while True:
            sleep_until_woken(woken, POLL_INTERVAL_S)
            if self._stop_signal is not None and not self._stopping:
                self._begin_stop(self._stop_signal)
            if self._gunicorn.poll() is not None:
                return self._finish()
            if not self._stopping:
                self._watch_engines()
                self._spare.watch(sum(e.alive and e.mark() == b"" for e in self._engines))

    def _start(self, engine: EngineProcess, standby: bool) -> None:
        engine.start(self._environ, next(self._generations), standby, self._spare)

    def _siblings(self, engine: EngineProcess) -> list[EngineProcess]:
        """The other engines of ``engine``'s device."""
        return [e for e in self._engines if e.index == engine.index and e is not engine]

    def _role(self, engine: EngineProcess) -> str:
        """As the front ends choose (``bridge/engines.py``): the ready engine of its device
        started first is active; the other ready ones are standbys."""
        if engine.mark() != READY_MARK:
            return "starting" if engine.mark() == b"" else "failed"
        older = [
            e
            for e in self._siblings(engine)
            if e.alive and e.mark() == READY_MARK and e.generation < engine.generation
        ]
        return "standby" if older else "active"

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only an attribute: the loop above does the work, outside the signal handler.
        self._stop_signal = signum

    def _forward_to_gunicorn(self, signum: int, frame: FrameType | None) -> None:
        if self._gunicorn is not None and self._gunicorn.poll() is None:
            self._gunicorn.send_signal(signum)

    def _begin_stop(self, signum: int, exit_status: int = 0) -> None:
        """Front ends first: they drain while the engines still answer."""
        self._stopping = True
        self._exit_status = self._exit_status or exit_status
        logger.info("supervisor_stopping", extra={"signal": signal.Signals(signum).name})
        assert self._gunicorn is not None
        if self._gunicorn.poll() is None:
            self._gunicorn.send_signal(signum)

    def _finish(self) -> int:
        """gunicorn has exited: stop the engines (they answer what is queued), then exit."""
        assert self._gunicorn is not None
        code = self._gunicorn.returncode
        if not self._stopping:
            logger.error("frontends_exited", extra={"exit_status": code})
            self._exit_status = self._exit_status or code or 1
        elif code not in (0, None) and self._stop_signal == signal.SIGTERM:
            self._exit_status = self._exit_status or code
        self._spare.stop()
        running = [e.process for e in self._engines if e.process and e.process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline_s = time.monotonic() + graceful_timeout_s(self._settings)
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("engine_killed_at_shutdown", extra={"pid": process.pid})
                process.kill()
                process.wait()
        logger.info("supervisor_stopped", extra={"exit_status": self._exit_status})
        return self._exit_status

    def _watch_engines(self) -> None:
        now_s = time.monotonic()
        for engine in self._engines:
            process = engine.process
            if process is None:
                continue
            code = process.poll()
            if code is None:
                quiet_s = engine.quiet_for_s()
                if quiet_s > engine.longest_quiet_s(self._settings):
                    logger.error(
                        "engine_unresponsive",
                        extra={
                            "engine": engine.index,
                            "slot": engine.slot,
                            "pid": process.pid,
                            "quiet_s": quiet_s,
                            "role": self._role(engine),
                        },
                    )
                    process.kill()
                elif now_s - engine.started_s > STANDBY_RETRY_S and engine.mark() == FAILED_MARK:
                    logger.warning(
                        "standby_restarted_after_failed_load",
                        extra={"engine": engine.index, "slot": engine.slot, "pid": process.pid},
                    )
                    process.kill()
                continue
            if engine.restart_at_s is None:
                self._engine_exited(engine, code, now_s)
            if engine.restart_at_s is not None and now_s >= engine.restart_at_s:
                self._start(engine, standby=any(e.alive for e in self._siblings(engine)))

    def _engine_exited(self, engine: EngineProcess, code: int, now_s: float) -> None:
        assert engine.process is not None
        _forget_gauges(engine.process.pid, self._environ)
        role = self._role(engine)
        if code == EXIT_LOAD_FAILED:
            logger.error("engine_cannot_load_model", extra={"engine": engine.index})
            self._begin_stop(signal.SIGTERM, exit_status=1)
            return
        lived_s = now_s - engine.started_s
        engine.young_deaths = 0 if lived_s > STABLE_AFTER_S else engine.young_deaths + 1
        wait_s = backoff_s(engine.young_deaths, FIRST_BACKOFF_S, LONGEST_BACKOFF_S)
        engine.restart_at_s = now_s + wait_s
        logger.error(
            "engine_exited",
            extra={
                "engine": engine.index,
                "slot": engine.slot,
                "pid": engine.process.pid,
                "exit_status": code,
                "restart_in_s": wait_s,
                "role": role,
                "standby_ready": [
                    e.process.pid
                    for e in self._siblings(engine)
                    if e.process is not None and e.alive and e.mark() == READY_MARK
                ],
            },
        )


def _slot_suffix(slot: int) -> str:
    return f"-standby{slot}" if slot else ""


def _forget_gauges(pid: int, environ: Mapping[str, str]) -> None:
    """A dead engine's live gauges (queue depth, memory) leave the aggregate."""
    with contextlib.suppress(FileNotFoundError):
        multiprocess.mark_process_dead(pid, environ[MULTIPROCESS_DIR_ENV])  # type: ignore[no-untyped-call]


def run_server(settings: Settings, overrides: Mapping[str, object]) -> int:
    """Serve with a supervisor, engine processes and gunicorn front ends until stopped."""
    environ = dict(os.environ) | settings_environment(overrides)
    metrics_dir, temporary_metrics = prepare_multiprocess_dir(environ)
    run_dir = Path(tempfile.mkdtemp(prefix="batchserve-run-"))
    environ[RUN_DIR_ENV] = str(run_dir)
    try:
        devices = engine_devices(settings.device, count_cuda_devices)
        engines = [
            EngineProcess(
                index=index,
                device=device,
                socket=run_dir / f"engine-{index}{_slot_suffix(slot)}.sock",
                heartbeat_file=run_dir / f"engine-{index}{_slot_suffix(slot)}.alive",
                slot=slot,
            )
            for index, device in enumerate(devices)
            for slot in range(1 + settings.standby_engines)
        ]
        environ[ENGINES_ENV] = orjson.dumps([[str(e.socket), e.device] for e in engines]).decode()
        sys.stdout.flush()
        return Supervisor(settings, environ, engines).run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if temporary_metrics:
            shutil.rmtree(metrics_dir, ignore_errors=True)
