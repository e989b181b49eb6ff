"""The spare engine interpreter (``spare_engine``) as the supervisor keeps it.

The spare itself, and why it pays, is ``service/engine/spare.py``. The next engine the
supervisor must start (a restart, a new standby) is the spare, given its variables; the
supervisor then starts a new spare, once no engine is loading (its imports would slow that
engine's load on a small host). A spare that dies is started again (after a growing wait if it
keeps dying before it is ready); one that fails as an engine is an engine that failed.

A ready spare must prove it is alive before it takes an engine's place: it answers its line
(``taken``, once that engine's heartbeat beats) within ``answer_timeout_s``, or it is killed
and the engine started fresh. A spare stopped (SIGSTOP) or wedged while it waited would
otherwise hold the place of an engine that never serves. One taken before it is ready is still
importing and cannot answer yet; it is held, as any starting engine, to its heartbeat.

The spare is a child like the engines: it dies with the supervisor, and stops with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping

import orjson

from service.processes import SPARE_READY, SPARE_TAKEN
from service.server.child_processes import backoff_s, die_with_parent

logger = logging.getLogger(__name__)

#: A spare that dies before it is ready, from its second such death in a row on, is started
#: again after this wait, doubling up to ``LONGEST_RETRY_S``: imports that fail every time
#: (a broken environment) must not keep a core busy.
FIRST_RETRY_S = 1.0
LONGEST_RETRY_S = 60.0
#: How long a spare may take to exit after SIGTERM when the server stops.
STOP_TIMEOUT_S = 10.0


def spare_command(ready_fd: int) -> list[str]:
    return [sys.executable, "-m", "service.engine.spare", "--ready-fd", str(ready_fd)]


def spare_wanted(enabled: bool, engines_loading: int) -> bool:
    """Whether to start a spare now (when none is alive): not while an engine loads, whose
    start it would slow on a small host; the spare is for the next start, not this one."""
    return enabled and engines_loading == 0


class SpareEngine:
    """The supervisor's spare: at most one process at a time, started with the engines'
    environment (``environ``: the settings, the metrics folder, the run folder); none at all
    unless ``enabled``. ``answer_timeout_s``: how long a ready spare may take to answer when
    it is taken (the engines' heartbeat timeout: a process quiet that long is hung)."""

    def __init__(
        self, environ: Mapping[str, str], enabled: bool = True, answer_timeout_s: float = 1.5
    ) -> None:
        self._environ = environ
        self._enabled = enabled
        self._answer_timeout_s = answer_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.ready = False
        self._ready_fd: int | None = None
        self._started_s = 0.0
        self._deaths_before_ready = 0
        self._start_at_s = 0.0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            self.process = subprocess.Popen(
                spare_command(write_fd),
                env=dict(self._environ),
                stdin=subprocess.PIPE,
                pass_fds=(write_fd,),
                preexec_fn=die_with_parent,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        os.set_blocking(read_fd, False)
        self._ready_fd = read_fd
        self._started_s = time.monotonic()
        logger.info("spare_engine_started", extra={"pid": self.process.pid})

    def _check_ready(self) -> None:
        if self.ready or self._ready_fd is None or self.process is None:
            return
        with contextlib.suppress(BlockingIOError):
            if os.read(self._ready_fd, len(SPARE_READY)) == SPARE_READY:
                self.ready = True
                logger.info(
                    "spare_engine_ready",
                    extra={
                        "pid": self.process.pid,
                        "imports_s": round(time.monotonic() - self._started_s, 3),
                    },
                )

    def take(self, variables: Mapping[str, str]) -> subprocess.Popen[bytes] | None:
        """The spare, told to become the engine of ``variables``; None when there is none to
        take, or it did not answer (start the engine fresh). A new spare is started later by
        ``watch``. Waits up to ``answer_timeout_s`` for a ready spare's answer."""
        if not self.alive:  # ready or not: one still importing is further on than a new one
            return None
        process = self.process
        assert process is not None
        assert process.stdin is not None
        self._check_ready()
        try:
            process.stdin.write(orjson.dumps(dict(variables)) + b"\n")
            process.stdin.close()
        except OSError:  # it died just now: start the engine fresh
            self._kill()
            return None
        if self.ready and not self._answered():
            logger.error(
                "spare_engine_unresponsive",
                extra={"pid": process.pid, "timeout_s": self._answer_timeout_s},
            )
            self._kill()
            return None
        logger.info("spare_engine_taken", extra={"pid": process.pid, "ready": self.ready})
        self._forget()
        return process

    def _answered(self) -> bool:
        """Whether the spare answers its line (``SPARE_TAKEN``) within ``answer_timeout_s``."""
        assert self._ready_fd is not None
        deadline_s = time.monotonic() + self._answer_timeout_s
        heard = b""
        while heard != SPARE_TAKEN:
            left_s = deadline_s - time.monotonic()
            if left_s <= 0 or not select.select([self._ready_fd], [], [], left_s)[0]:
                return False
            chunk = os.read(self._ready_fd, len(SPARE_TAKEN) - len(heard))
            if not chunk:  # the pipe closed: it died
                return False
            heard += chunk
        return True

    def _kill(self) -> None:
        """Kill the spare (dead or unresponsive) and forget it; a new one is started later."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        self._forget()

    def watch(self, engines_loading: int) -> None:
        """Replace a spare that died; start one when none is alive and ``spare_wanted``, with
        ``engines_loading`` engines started and not yet loaded."""
        now_s = time.monotonic()
        if self.process is not None:
            self._check_ready()
            code = self.process.poll()
            if code is None:
                return
            self._deaths_before_ready = 0 if self.ready else self._deaths_before_ready + 1
            wait_s = backoff_s(self._deaths_before_ready, FIRST_RETRY_S, LONGEST_RETRY_S)
            self._start_at_s = now_s + wait_s
            logger.error(
                "spare_engine_exited",
                extra={
                    "pid": self.process.pid,
                    "exit_status": code,
                    "ready": self.ready,
                    "restart_in_s": wait_s,
                },
            )
            self._forget()
        if spare_wanted(self._enabled, engines_loading) and now_s >= self._start_at_s:
            self.start()

    def stop(self) -> None:
        """Stop the spare (the server stops): it serves nothing, so SIGTERM ends it at once."""
        process = self.process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._forget()

    def _forget(self) -> None:
        if self.process is not None and self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        if self._ready_fd is not None:
            os.close(self._ready_fd)
        self.process = None
        self.ready = False
        self._ready_fd = None
