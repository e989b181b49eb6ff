"""The supervisor's restart policy, its wake-up on a child's exit and its standbys, without
servers (fake engine processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import Settings
from service.metrics import MULTIPROCESS_DIR_ENV
from service.processes import (
    ENGINE_HEARTBEAT_FILE_ENV,
    ENGINE_STANDBY_ENV,
    FAILED_MARK,
    READY_MARK,
)
from service.server import supervisor
from service.server.child_processes import backoff_s, sleep_until_woken, wake_on_signals
from service.server.supervisor import FIRST_BACKOFF_S, LONGEST_BACKOFF_S, EngineProcess, Supervisor


def restart_delay_s(young_deaths: int) -> float:
    return backoff_s(young_deaths, FIRST_BACKOFF_S, LONGEST_BACKOFF_S)


def test_an_engine_that_had_been_serving_is_restarted_at_once() -> None:
    assert restart_delay_s(0) == 0.0


def test_the_first_young_death_is_restarted_at_once() -> None:
    """A lone crash soon after a start (a restart, or a kill during a test) is the common
    case: waiting would only lengthen the outage."""
    assert restart_delay_s(1) == 0.0


def test_repeated_young_deaths_wait_longer_each_time_up_to_the_longest() -> None:
    waits = [restart_delay_s(deaths) for deaths in range(2, 12)]
    assert waits[0] == FIRST_BACKOFF_S
    assert waits == sorted(waits)
    assert waits[1] == 2 * FIRST_BACKOFF_S
    assert waits[-1] == LONGEST_BACKOFF_S


@pytest.fixture
def woken() -> Iterator[int]:
    previous = signal.getsignal(signal.SIGCHLD)
    read_fd = wake_on_signals()
    try:
        yield read_fd
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, previous)


def test_a_child_exit_ends_the_sleep_long_before_its_limit(woken: int) -> None:
    longest_s = 30.0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started_s = time.monotonic()
    sleep_until_woken(woken, longest_s)
    assert time.monotonic() - started_s < longest_s / 2
    assert child.wait() == 0


def test_without_a_signal_the_sleep_lasts_its_limit(woken: int) -> None:
    started_s = time.monotonic()
    sleep_until_woken(woken, 0.2)
    assert time.monotonic() - started_s >= 0.2


#: An engine that loads nothing: a standby marks its heartbeat file failed, any other ready.
ENGINE_MARKING_ITS_LOAD = f"""
import os, time
standby = os.environ["{ENGINE_STANDBY_ENV}"] == "1"
path = os.environ["{ENGINE_HEARTBEAT_FILE_ENV}"]
with open(path, "wb") as marked:
    marked.write({FAILED_MARK!r} if standby else {READY_MARK!r})
time.sleep(60)
"""


def test_a_standby_that_cannot_load_stays_up_and_is_started_again_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        supervisor, "engine_command", lambda: [sys.executable, "-c", ENGINE_MARKING_ITS_LOAD]
    )
    monkeypatch.setattr(supervisor, "STANDBY_RETRY_S", 0.0)
    engines = [
        EngineProcess(0, "cpu", tmp_path / f"{slot}.sock", tmp_path / f"{slot}.alive", slot=slot)
        for slot in (0, 1)
    ]
    watcher = Supervisor(Settings(), {**os.environ, MULTIPROCESS_DIR_ENV: str(tmp_path)}, engines)
    active, standby = engines
    try:
        for engine in engines:
            watcher._start(engine, standby=engine.slot > 0)
        deadline_s = time.monotonic() + 30.0
        while standby.mark() != FAILED_MARK or active.mark() != READY_MARK:
            assert time.monotonic() < deadline_s, "the fake engines never marked their load"
            time.sleep(0.05)
        first = standby.process
        assert first is not None
        watcher._watch_engines()  # failed since its start: killed, to be started again
        first.wait(timeout=30.0)
        watcher._watch_engines()  # its exit noticed: started again at once, as a standby
        assert standby.process is not first
        assert standby.generation == 2
        assert active.alive  # the active engine serves on: nothing stops the server
        assert not watcher._stopping
    finally:
        for engine in engines:
            if engine.process is not None and engine.alive:
                engine.process.kill()
                engine.process.wait()


def short_limits(start_timeout_s: float) -> Settings:
    """Limits short enough for a test; no spare (the engines are fakes)."""
    return Settings(
        engine_heartbeat_interval_s=0.1,
        engine_heartbeat_timeout_s=0.5,
        engine_start_heartbeat_timeout_s=start_timeout_s,
        spare_engine=False,
    )


#: An engine that starts and never beats: stopped, or wedged before its first heartbeat.
ENGINE_NEVER_BEATING = "import time; time.sleep(60)"
#: An engine that beats while it starts (as its thread does) for 2 s, then marks itself loaded.
ENGINE_BEATING_WHILE_IT_STARTS = f"""
import os, time
path = os.environ["{ENGINE_HEARTBEAT_FILE_ENV}"]
for _ in range(20):
    os.utime(path)
    time.sleep(0.1)
with open(path, "wb") as marked:
    marked.write({READY_MARK!r})
while True:
    os.utime(path)
    time.sleep(0.1)
"""


def watched_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, settings: Settings
) -> tuple[Supervisor, EngineProcess]:
    monkeypatch.setattr(supervisor, "engine_command", lambda: [sys.executable, "-c", code])
    engine = EngineProcess(0, "cpu", tmp_path / "0.sock", tmp_path / "0.alive")
    environ = {**os.environ, MULTIPROCESS_DIR_ENV: str(tmp_path)}
    return Supervisor(settings, environ, [engine]), engine


def test_a_starting_engine_that_never_beats_is_killed_at_the_start_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, an engine that had never touched its heartbeat file was never declared hung:
    one stopped before its first heartbeat held its device for good."""
    settings = short_limits(start_timeout_s=0.5)
    watcher, engine = watched_engine(tmp_path, monkeypatch, ENGINE_NEVER_BEATING, settings)
    try:
        watcher._start(engine, standby=False)
        first = engine.process
        assert first is not None
        deadline_s = time.monotonic() + 30.0
        while first.poll() is None:
            assert time.monotonic() < deadline_s, "the silent engine was never killed"
            watcher._watch_engines()
            time.sleep(0.05)
        assert first.returncode == -signal.SIGKILL
        assert time.monotonic() - engine.started_s >= settings.engine_start_heartbeat_timeout_s
        watcher._watch_engines()  # its death noticed: started again at once
        assert engine.process is not first
        assert engine.alive
    finally:
        if engine.process is not None and engine.alive:
            engine.process.kill()
            engine.process.wait()


def test_a_starting_engine_that_beats_is_left_to_start_however_long_it_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = short_limits(start_timeout_s=1.0)  # ten beats; it starts for twice as long
    watcher, engine = watched_engine(
        tmp_path, monkeypatch, ENGINE_BEATING_WHILE_IT_STARTS, settings
    )
    try:
        watcher._start(engine, standby=False)
        deadline_s = time.monotonic() + 30.0
        while engine.mark() != READY_MARK:
            assert time.monotonic() < deadline_s, "the fake engine never marked its load"
            watcher._watch_engines()
            time.sleep(0.05)
        assert engine.alive
        assert engine.starts == 1
    finally:
        if engine.process is not None and engine.alive:
            engine.process.kill()
            engine.process.wait()
