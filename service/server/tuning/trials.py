"""Serve a candidate (or the HTTP ceiling) as its own process on a free loopback port,
measure it under closed-loop load, and stop it.

Each server leads its own process group, so stopping it also stops what it started (the
engine, gunicorn's workers) even if it dies first. Ready and stop waits are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from service.server.tuning.load import LoadResult, closed_loop
from service.server.tuning.search import Result
from service.server.tuning.space import Candidate

STOP_TIMEOUT_S = 15.0
POLL_INTERVAL_S = 0.1


class TrialError(RuntimeError):
    """A server that exited or never became ready; the message holds the end of its log."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def serve_command() -> list[str]:
    return [sys.executable, "-m", "service.server.cli", "serve"]


def ceiling_command() -> list[str]:
    return [sys.executable, "-m", "service.server.tuning.ceiling", "--port", "{port}"]


@dataclass(frozen=True)
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, characters: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-characters:]
        except OSError:
            return ""


def start(command: Sequence[str], environ: Mapping[str, str], log: Path) -> Server:
    port = free_port()
    env = dict(environ) | {"BATCHSERVE_HOST": "127.0.0.1", "BATCHSERVE_PORT": str(port)}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as output:
        process = subprocess.Popen(
            [part.format(port=port) for part in command],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Server(f"http://127.0.0.1:{port}", process, log)


async def wait_ready(server: Server, timeout_s: float) -> None:
    deadline_s = time.monotonic() + timeout_s
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline_s:
            if server.process.poll() is not None:
                raise TrialError(
                    f"the server exited with status {server.process.returncode}:\n"
                    f"{server.log_tail()}"
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(server.url + "/readyz") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(POLL_INTERVAL_S)
    raise TrialError(f"the server was not ready after {timeout_s:.0f} s:\n{server.log_tail()}")


async def stop(server: Server) -> None:
    """SIGTERM to the server, SIGKILL to its whole group if it has not exited in time."""
    process = server.process
    if process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(process.wait, STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_TIMEOUT_S)


@contextlib.asynccontextmanager
async def serving(
    command: Sequence[str], environ: Mapping[str, str], log: Path, ready_timeout_s: float
) -> AsyncIterator[Server]:
    server = start(command, environ, log)
    try:
        await wait_ready(server, ready_timeout_s)
        yield server
    finally:
        await stop(server)


def tree_rss_bytes(root: int, proc: Path = Path("/proc")) -> int:
    """Resident memory of ``root`` and its descendants (Linux ``/proc``; 0 elsewhere)."""
    parents: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in proc.iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = (entry / "stat").read_text()
                    parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    tree = [root]
    for pid in tree:  # grows while walked; each process has one parent, so it ends
        tree += [child for child, parent in parents.items() if parent == pid]
    total = 0
    for pid in tree:
        with contextlib.suppress(OSError, ValueError):
            for line in (proc / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


@dataclass(frozen=True)
class Measurement:
    """How long each trial measures and warms up, and its limits."""

    concurrency: int
    duration_s: float
    warmup_s: float
    ready_timeout_s: float


def result_of(candidate: Candidate, load: LoadResult, memory_bytes: int) -> Result:
    return Result(
        candidate=candidate,
        throughput_rps=load.throughput_rps,
        p50_ms=load.percentile_ms(0.5),
        p99_ms=load.percentile_ms(0.99),
        errors=load.errors,
        memory_bytes=memory_bytes,
        answered=len(load.latencies_ms),
    )


async def measure_server(
    server: Server, bodies: Sequence[bytes], measurement: Measurement, warm: bool = True
) -> tuple[LoadResult, int]:
    load = await closed_loop(
        server.url,
        bodies,
        concurrency=measurement.concurrency,
        duration_s=measurement.duration_s,
        warmup_s=measurement.warmup_s if warm else 0.0,
    )
    return load, tree_rss_bytes(server.process.pid)


async def run_trial(
    candidate: Candidate,
    environ: Mapping[str, str],
    bodies: Sequence[bytes],
    measurement: Measurement,
    log: Path,
) -> Result:
    """Serve ``candidate`` and measure it once."""
    env = dict(environ) | candidate.environment()
    async with serving(serve_command(), env, log, measurement.ready_timeout_s) as server:
        return await measure_candidate(candidate, server, bodies, measurement)


async def measure_candidate(
    candidate: Candidate, server: Server, bodies: Sequence[bytes], measurement: Measurement
) -> Result:
    load, memory_bytes = await measure_server(server, bodies, measurement)
    return result_of(candidate, load, memory_bytes)


async def ceiling_rps(
    workers: int,
    environ: Mapping[str, str],
    bodies: Sequence[bytes],
    measurement: Measurement,
    log: Path,
    meanwhile: Awaitable[object] | None = None,
) -> float:
    """Requests/s of the HTTP ceiling (the real front end, a model that costs nothing).
    ``meanwhile`` (another server starting) is awaited before the load starts, so that its
    start overlaps this one's but never its measurement."""
    env = dict(environ) | {"BATCHSERVE_WORKERS": str(workers)}
    async with serving(ceiling_command(), env, log, measurement.ready_timeout_s) as server:
        if meanwhile is not None:
            await meanwhile
        load, _ = await measure_server(server, bodies, measurement)
    return load.throughput_rps


async def start_ready(
    candidate: Candidate, environ: Mapping[str, str], ready_timeout_s: float, log: Path
) -> Server:
    """Serve ``candidate``; the caller stops it (``stop``), also when it never gets ready."""
    server = start(serve_command(), dict(environ) | candidate.environment(), log)
    try:
        await wait_ready(server, ready_timeout_s)
    except BaseException:
        await stop(server)
        raise
    return server


async def interleaved(
    served: Sequence[tuple[Candidate, Server]],
    bodies: Sequence[bytes],
    measurement: Measurement,
    rounds: int,
) -> list[list[Result]]:
    """Measure servers running side by side in turn, ``rounds`` times, so that load from
    elsewhere on the host falls on each alike. One list of results per server."""
    results: list[list[Result]] = [[] for _ in served]
    for _ in range(rounds):
        for index, (candidate, server) in enumerate(served):
            load, memory_bytes = await measure_server(server, bodies, measurement)
            results[index].append(result_of(candidate, load, memory_bytes))
    return results
