"""An engine beats its heartbeat file from a thread while it starts
(``engine/starting_heartbeat.py``), from before it imports torch: a slow start is not a hang,
and a stopped process touches nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from service.engine.starting_heartbeat import StartingHeartbeat
from service.processes import ENGINE_HEARTBEAT_FILE_ENV
from tests.processes import REPOSITORY_ROOT


def never_touched(path: Path) -> Path:
    path.write_bytes(b"")
    os.utime(path, (0, 0))
    return path


def test_it_touches_the_file_at_once_then_every_interval_until_stopped(tmp_path: Path) -> None:
    path = never_touched(tmp_path / "engine.alive")
    heartbeat = StartingHeartbeat(path, interval_s=0.05).start()
    try:
        first_s = path.stat().st_mtime
        assert first_s != 0  # at once, not an interval later
        deadline_s = time.monotonic() + 10.0
        while path.stat().st_mtime == first_s:
            assert time.monotonic() < deadline_s, "touched only once"
            time.sleep(0.05)
        assert heartbeat.beating
    finally:
        heartbeat.stop()
    assert not heartbeat.beating  # the thread has ended: it touches nothing more


def test_without_a_file_it_does_nothing() -> None:
    heartbeat = StartingHeartbeat(None, interval_s=0.05).start()
    assert not heartbeat.beating
    heartbeat.stop()


#: Runs the engine's entry point up to the moment its heartbeat beats, and reports then.
ENGINE_UP_TO_ITS_FIRST_BEAT = """
import os, sys
from service.engine import process
def beating():
    print(os.stat(os.environ["{variable}"]).st_mtime != 0, "torch" in sys.modules, flush=True)
    os._exit(0)
process.main(beating)
"""


def test_an_engine_beats_before_it_imports_torch(tmp_path: Path) -> None:
    """Importing torch and the engine takes seconds (tens on a loaded host): before, an engine
    touched its heartbeat file only once its event loop ran, after them."""
    path = never_touched(tmp_path / "engine.alive")
    code = ENGINE_UP_TO_ITS_FIRST_BEAT.format(variable=ENGINE_HEARTBEAT_FILE_ENV)
    ran = subprocess.run(
        [sys.executable, "-c", code],
        env=os.environ | {ENGINE_HEARTBEAT_FILE_ENV: str(path)},
        cwd=REPOSITORY_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["True", "False"]  # touched; torch not imported yet
