"""Serve a candidate (or the HTTP ceiling) as its own process on a loopback port, measure
it under closed-loop load, and stop it.

Each server is one of ``tune``'s ``Children``: it dies with ``tune``, and stopping it stops
what it started. Its port is one the kernel chose (a bind to port 0), and ``tune`` keeps it
bound, without listening, until the server has stopped: no other program binds it and no
outgoing connection takes it meanwhile, while the server, which binds with
``SO_REUSEADDR``, still can. Ready and stop waits are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import aiohttp

from service.server.tuning.children import Children
from service.server.tuning.load import Body, LoadResult, closed_loop
from service.server.tuning.search import Result
from service.server.tuning.space import Candidate

POLL_INTERVAL_S = 0.1


class TrialError(RuntimeError):
    """A server that exited or never became ready; the message holds the end of its log."""


def reserve_port() -> socket.socket:
    """A loopback port the kernel chose, held bound (not listening) by the socket returned:
    only a server binding with ``SO_REUSEADDR`` (uvicorn, gunicorn) can take it too."""
    reservation = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reservation.bind(("127.0.0.1", 0))
    return reservation


def serve_command() -> list[str]:
    """``batchserve serve``; the candidate's settings go in its environment."""
    return [sys.executable, "-m", "service.server.cli", "serve"]


def ceiling_command() -> list[str]:
    return [sys.executable, "-m", "service.server.tuning.ceiling", "--port", "{port}"]


@dataclass(frozen=True)
class Server:
    url: str
    process: Popen[bytes]
    log: Path
    reservation: socket.socket
    """Holds the server's port until it has stopped."""

    def log_tail(self, characters: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-characters:]
        except OSError:
            return ""


def start(
    children: Children, command: Sequence[str], environ: Mapping[str, str], log: Path
) -> Server:
    reservation = reserve_port()
    try:
        port: int = reservation.getsockname()[1]
        env = dict(environ) | {"BATCHSERVE_HOST": "127.0.0.1", "BATCHSERVE_PORT": str(port)}
        process = children.start([part.format(port=port) for part in command], env, log)
    except BaseException:
        reservation.close()
        raise
    return Server(f"http://127.0.0.1:{port}", process, log, reservation)


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


async def stop(children: Children, server: Server) -> None:
    """SIGTERM to the server, SIGKILL to its whole group if it has not exited in time; its
    port is released once it has."""
    try:
        await children.stop(server.process)
    finally:
        server.reservation.close()


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


async def measure_server(
    server: Server, bodies: Sequence[Body], measurement: Measurement
) -> LoadResult:
    return await closed_loop(
        server.url,
        bodies,
        concurrency=measurement.concurrency,
        duration_s=measurement.duration_s,
        warmup_s=measurement.warmup_s,
    )


async def measure_candidate(
    candidate: Candidate, server: Server, bodies: Sequence[Body], measurement: Measurement
) -> Result:
    load = await measure_server(server, bodies, measurement)
    return Result(
        candidate=candidate,
        throughput_rps=load.throughput_rps,
        p50_ms=load.percentile_ms(0.5),
        p99_ms=load.percentile_ms(0.99),
        errors=load.errors,
        memory_bytes=tree_rss_bytes(server.process.pid),
        answered=len(load.latencies_ms),
    )


async def ceiling_load(
    children: Children,
    workers: int,
    environ: Mapping[str, str],
    bodies: Sequence[Body],
    measurement: Measurement,
    log: Path,
    meanwhile: Awaitable[object] | None = None,
) -> LoadResult:
    """The HTTP ceiling's load (the real front end, a model that costs nothing) with
    ``workers`` front ends. ``meanwhile`` (another server starting) is awaited before the load
    starts, so that its start overlaps this one's but never its measurement."""
    env = dict(environ) | {"BATCHSERVE_WORKERS": str(workers)}
    server = await start_ready(children, ceiling_command(), env, measurement.ready_timeout_s, log)
    try:
        if meanwhile is not None:
            await meanwhile
        return await measure_server(server, bodies, measurement)
    finally:
        await stop(children, server)


async def start_ready(
    children: Children,
    command: Sequence[str],
    environ: Mapping[str, str],
    ready_timeout_s: float,
    log: Path,
) -> Server:
    """A server ready to answer (the caller stops it), or stopped when it never gets ready."""
    server = start(children, command, environ, log)
    try:
        await wait_ready(server, ready_timeout_s)
    except BaseException:
        await stop(children, server)
        raise
    return server


async def interleaved(
    served: Sequence[tuple[Candidate, Server]],
    bodies: Sequence[Body],
    measurement: Measurement,
    rounds: int,
) -> list[list[Result]]:
    """Measure servers running side by side in turn, ``rounds`` times, so that load from
    elsewhere on the host falls on each alike. One list of results per server."""
    results: list[list[Result]] = [[] for _ in served]
    for _ in range(rounds):
        for index, (candidate, server) in enumerate(served):
            results[index].append(await measure_candidate(candidate, server, bodies, measurement))
    return results
