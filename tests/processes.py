"""Real processes for the deployment tests: ``batchserve serve`` and tools found on the PATH.

Every process listens on a free 127.0.0.1 port, writes its output to a file under the test's
``tmp_path`` (shown when the test fails), and is killed when its ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

BATCHSERVE = Path(sys.executable).with_name("batchserve")
REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
POLL_INTERVAL_S = 0.1
#: How long a server may take to start, load and warm up: seconds when the machine is quiet,
#: but over a minute beside other engineers' load (a 60 s wait failed tests whose point was
#: elsewhere). Only a failing test waits this long.
START_TIMEOUT_S = 180.0
#: How long a stopped process may take to exit (gunicorn drains its workers first).
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def require_tool(name: str) -> str:
    """The path of ``name`` on the PATH; skip the test without it, except in CI (``CI=true``),
    whose set-up installs it, where a missing tool fails the test instead."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is not installed (apt-get install --no-install-recommends prometheus)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}; .ci/run installs it, so CI must have it")
    pytest.skip(message)


@dataclass
class Running:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def running(
    command: Sequence[str], url: str, log: Path, env: Mapping[str, str]
) -> Iterator[Running]:
    """Start ``command``; when the block ends, stop it if it still runs: SIGTERM, so that
    gunicorn's master stops its workers too, then SIGKILL if it has not exited in time."""
    with log.open("wb") as output:
        process = subprocess.Popen(
            list(command), env=dict(env), stdout=output, stderr=subprocess.STDOUT
        )
    try:
        yield Running(process=process, url=url, log=log)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT_S)


def batchserve_environment(port: int, **variables: str) -> dict[str, str]:
    """The test's environment plus a CPU, 127.0.0.1 batchserve on ``port``."""
    return os.environ | {
        "BATCHSERVE_HOST": "127.0.0.1",
        "BATCHSERVE_PORT": str(port),
        "BATCHSERVE_DEVICE": "cpu",
        "BATCHSERVE_TORCH_THREADS": "1",
        **variables,
    }


def wait_for(
    condition: Callable[[], bool], what: str, server: Running, timeout_s: float = START_TIMEOUT_S
) -> None:
    """Poll ``condition`` until it holds; fail with the server's output if the server exits
    first or ``timeout_s`` passes."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if condition():
            return
        if server.process.poll() is not None:
            pytest.fail(f"exited ({server.process.returncode}) before {what}:\n{server.output()}")
        time.sleep(POLL_INTERVAL_S)
    pytest.fail(f"not {what} after {timeout_s} s:\n{server.output()}")


def answers(url: str, status: int = 200) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == status
    except httpx.TransportError:
        return False


def scraped(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of ``url``/metrics (0 when absent): the sum over every process, and over
    the series whose labels include ``labels`` (every model's, unless ``labels`` names one)."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    wanted = (labels or {}).items()
    return float(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and wanted <= sample.labels.items()
        )
    )


@contextlib.contextmanager
def serve_with_engines(tmp_path: Path, workers: int, **variables: str) -> Iterator[Running]:
    """``batchserve serve`` with a supervisor, engine processes and ``workers`` front ends."""
    port = free_port()
    env = batchserve_environment(
        port, BATCHSERVE_WORKERS=str(workers), BATCHSERVE_ENGINE_MODE="process", **variables
    )
    url = f"http://127.0.0.1:{port}"
    with running([str(BATCHSERVE), "serve"], url, tmp_path / "server.log", env) as server:
        yield server


def wait_for_spare(server: Running) -> None:
    """The supervisor's spare engine interpreter has done its imports (``spare_engine``): it
    starts once the engines are ready and imports torch for seconds, so a test that times a
    fault waits for it, as a server in production is past it."""
    wait_for(
        lambda: '"event":"spare_engine_ready"' in server.output(),
        "the spare engine interpreter ready",
        server,
    )


def wait_until_serving(server: Running, workers: int, engines: int = 1) -> None:
    """Every front end started, and every one of them reaches ``engines`` ready engines."""
    wait_for(
        lambda: server.output().count('"event":"frontend_ready"') >= workers,
        f"{workers} front ends ready",
        server,
    )

    def all_engines_ready() -> bool:
        try:
            return scraped(server.url, "batchserve_engines_ready") == engines
        except httpx.TransportError:
            return False

    wait_for(all_engines_ready, f"{engines} engine(s) ready in every front end", server)


def engine_pids(server: Running) -> list[int]:
    """The engine processes, in device order, as a front end sees them."""
    engines = httpx.get(server.url + "/models", timeout=5.0).json()["engines"]
    return [int(engine["pid"]) for engine in engines]


def children_of(pid: int) -> list[int]:
    listed = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(child) for child in listed.stdout.split()]


def frontend_pids(server: Running) -> list[int]:
    """The gunicorn workers: children of the supervisor's child that is not an engine."""
    engines = set(engine_pids(server))
    masters = [pid for pid in children_of(server.process.pid) if pid not in engines]
    return [pid for master in masters for pid in children_of(master)]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone, or going mid-read
        return False
    return state != "Z"


def logged(server: Running, event: str) -> list[dict[str, Any]]:
    """The server's JSON log records of ``event``, in order."""
    marker = f'"event":"{event}"'
    return [orjson.loads(line) for line in server.output().splitlines() if marker in line]


def logged_s(record: dict[str, Any]) -> float:
    """When ``record`` was logged (the wall clock's seconds)."""
    return datetime.fromisoformat(str(record["ts"])).timestamp()


def engine_environment(pid: int) -> dict[str, str]:
    """The environment a running process was started with."""
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(pair.decode().split("=", 1) for pair in pairs if b"=" in pair)
