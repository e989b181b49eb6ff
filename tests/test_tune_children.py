"""``tuning.children``: what ``tune`` starts dies with it, whether it is told to stop
(SIGTERM, SIGINT) or killed; once told, it starts nothing more. Small Python programs stand in
for the servers (``tests/test_tune.py`` stops a real ``tune``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.server.tuning.children import (
    Children,
    NoMoreChildrenError,
    StopSignalError,
    until_stopped,
)
from tests.processes import alive

#: Starts a grandchild in its own group, writes its id, and waits: a server with an engine.
WITH_GRANDCHILD = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)
WAIT_S = 60.0
POLL_S = 0.05


def wait_until(condition: object, what: str) -> None:
    assert callable(condition)
    deadline_s = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline_s:
            raise AssertionError(f"not within {WAIT_S:.0f} s: {what}")
        time.sleep(POLL_S)


def first_line(path: Path) -> str:
    wait_until(lambda: path.exists() and path.read_text().endswith("\n"), f"a line in {path}")
    return path.read_text().splitlines()[0]


def test_stop_all_stops_every_child_and_what_it_started(tmp_path: Path) -> None:
    children = Children()
    log = tmp_path / "child.log"
    child = children.start([sys.executable, "-c", WITH_GRANDCHILD], os.environ, log)
    grandchild = int(first_line(log))
    children.stop_all(timeout_s=5.0)
    assert child.returncode is not None
    wait_until(lambda: not alive(grandchild), "the grandchild gone with its group")
    assert children.running() == []


def test_once_told_to_stop_no_child_is_started(tmp_path: Path) -> None:
    children = Children()
    children.terminate()
    with pytest.raises(NoMoreChildrenError):
        children.start([sys.executable, "-c", "pass"], os.environ, tmp_path / "child.log")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_cancels_the_run_after_its_own_clean_up(
    tmp_path: Path, signum: signal.Signals
) -> None:
    children = Children()
    started: list[subprocess.Popen[bytes]] = []
    cleaned_up: list[str] = []

    async def work() -> None:
        command = [sys.executable, "-c", "import time; time.sleep(600)"]
        started.append(children.start(command, os.environ, tmp_path / "child.log"))
        try:
            os.kill(os.getpid(), signum)
            await asyncio.sleep(600)
        finally:
            cleaned_up.append("yes")

    with pytest.raises(StopSignalError) as stopped:
        asyncio.run(until_stopped(work(), children))
    assert stopped.value.signum == signum
    assert cleaned_up == ["yes"]
    assert children.closed  # no more starts, and SIGTERM sent to the child
    children.stop_all(timeout_s=5.0)
    assert started[0].returncode == -signal.SIGTERM


#: Starts one child through ``Children`` and writes its id; then is killed by the test.
PARENT = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from service.server.tuning.children import Children\n"
    "child = Children().start([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
    "                         os.environ, Path(sys.argv[1]))\n"
    "print(child.pid, flush=True)\n"
    "import time; time.sleep(600)\n"
)


def test_a_child_gets_sigterm_when_tune_is_killed(tmp_path: Path) -> None:
    """SIGKILL runs nothing of the parent: the kernel signals the child
    (``PR_SET_PDEATHSIG``), which its start asked for before becoming the command."""
    out = tmp_path / "parent.out"
    with out.open("w") as output:
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT, str(tmp_path / "child.log")], stdout=output
        )
    child = int(first_line(out))
    try:
        assert alive(child)
        parent.kill()
        parent.wait()
        wait_until(lambda: not alive(child), "the child gone with its parent")
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
