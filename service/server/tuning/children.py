"""The processes ``tune`` starts (trial servers, the HTTP ceiling) die with it.

Each leads a process group of its own, so that stopping it stops what it started (an
engine, gunicorn's workers) even if it dies first. ``Children`` keeps every one: SIGTERM or
SIGINT to ``tune`` stops it starting more, sends SIGTERM to each, and on its way out each
group still there gets SIGKILL; ``tune`` then exits with 128 + the signal's number.

If ``tune`` itself is killed (SIGKILL, where nothing of it runs), the kernel sends each
child SIGTERM (``PR_SET_PDEATHSIG``, as the supervisor does for its engines). A child asks
for that as its first step, through this module run as a program
(``python -m service.server.tuning.children PARENT_PID COMMAND...``), which then checks that
``tune`` has not died already and becomes the command (``exec`` keeps the request). Not
``preexec_fn``: ``tune`` has threads (torch's, asyncio's), and Python run between ``fork``
and ``exec`` in a process with threads can deadlock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from service.server.child_processes import die_with_parent

#: How long a child has to exit after SIGTERM before its group gets SIGKILL.
STOP_TIMEOUT_S = 15.0
#: The same once ``tune`` was told to stop: whoever sent the signal is waiting.
STOP_AFTER_SIGNAL_S = 5.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

T = TypeVar("T")


class StopSignalError(Exception):
    """``tune`` received SIGTERM or SIGINT: its run was cancelled."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class NoMoreChildrenError(RuntimeError):
    """A start asked for after ``tune`` was told to stop."""


def guarded(command: Sequence[str], parent_pid: int) -> list[str]:
    """``command`` started so that it gets SIGTERM when ``parent_pid`` dies."""
    return [sys.executable, "-m", __name__, str(parent_pid), *command]


class Children:
    """Every process ``tune`` started and has not stopped yet."""

    def __init__(self) -> None:
        self._running: list[subprocess.Popen[bytes]] = []
        self.closed = False

    def start(
        self, command: Sequence[str], environ: Mapping[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        """Start ``command`` leading a group of its own, its output into ``log``. Called on
        the main thread: the kernel's parent-death signal follows the thread that started it."""
        if self.closed:
            raise NoMoreChildrenError("tune is stopping: no more servers are started")
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as output:
            process = subprocess.Popen(
                guarded(command, os.getpid()),
                env=dict(environ),
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._running.append(process)
        return process

    def running(self) -> list[subprocess.Popen[bytes]]:
        return list(self._running)

    def terminate(self) -> None:
        """Start no more; SIGTERM to every child still running (it stops what it started)."""
        self.closed = True
        for process in self._running:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()

    async def stop(
        self, process: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S
    ) -> None:
        """SIGTERM to ``process``, SIGKILL to its whole group once it has exited or after
        ``timeout_s``, and forget it."""
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(process.wait, timeout_s)
        self._kill_group(process)

    def stop_all(self, timeout_s: float) -> None:
        """SIGTERM to every child, then, within ``timeout_s`` all told, SIGKILL to each group
        and wait for each: nothing ``tune`` started outlives this call."""
        self.terminate()
        deadline_s = time.monotonic() + timeout_s
        for process in list(self._running):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline_s - time.monotonic()))
            self._kill_group(process)

    def _kill_group(self, process: subprocess.Popen[bytes]) -> None:
        """SIGKILL to what is left of ``process``'s group (right after its leader was seen to
        exit, before its id can be reused), then reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(ValueError):
            self._running.remove(process)


async def until_stopped(work: Coroutine[Any, Any, T], children: Children) -> T:
    """``work``'s result; ``StopSignalError`` when SIGTERM or SIGINT came first, after ``work`` was
    cancelled (its own clean-up ran) and ``children`` were told to stop."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    received: list[int] = []

    def stop(signum: int) -> None:
        received.append(signum)
        children.terminate()
        task.cancel()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop, signum)
    try:
        return await task
    except asyncio.CancelledError:
        if received:
            raise StopSignalError(received[0]) from None
        raise
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)


def main(argv: Sequence[str]) -> None:
    """``PARENT_PID COMMAND...``: become ``COMMAND``, to get SIGTERM when the parent dies."""
    parent_pid, *command = argv
    die_with_parent()
    if os.getppid() != int(parent_pid):
        sys.exit(f"tune (process {parent_pid}) ended before {command[0]} could start")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
