"""Start, wait for and stop the server processes under test, all on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from service.config import ENV_PREFIX

BATCHSERVE = Path(sys.executable).with_name("batchserve")
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


class ServerError(RuntimeError):
    """The server exited, never became ready, or refused the workload's first requests."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def check_loopback(url: str) -> str:
    """``url`` without a trailing slash; refuses anything but this machine's loopback."""
    host = urlsplit(url).hostname
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"load tests only target 127.0.0.1 (or localhost), got {url!r}")
    return url.rstrip("/")


def server_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without inherited ``BATCHSERVE_*`` variables, plus ``overrides``.

    Inherited settings would silently change every configuration; pass them with ``--set``.
    """
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    return inherited | dict(overrides)


def _tail(path: Path, characters: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-characters:]
    except OSError:
        return ""


def wait_ready(
    process: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float, path: str = "/readyz"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"exited with status {process.returncode}:\n{_tail(log)}")
        with contextlib.suppress(httpx.TransportError):
            response = httpx.get(url + path, timeout=2.0)
            if response.status_code == 200:
                return
            if response.status_code != 503:  # 503: still loading
                raise ServerError(
                    f"{path} answered {response.status_code}: {response.text[:500]}\n{_tail(log)}"
                )
        time.sleep(0.2)
    raise ServerError(f"not ready after {timeout_s:.0f} s:\n{_tail(log)}")


def stop(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@dataclass(frozen=True)
class RunningServer:
    url: str
    pid: int
    """The process started: the server, its supervisor, or gunicorn's master."""


@contextlib.contextmanager
def serving(
    command: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    ready_timeout_s: float,
    cwd: Path | None = None,
) -> Iterator[RunningServer]:
    """Run ``command`` (which must take ``BATCHSERVE_PORT``/``--port``) in ``cwd`` until the
    block ends.

    ``command`` may contain ``{port}``; the server's output goes to ``log``.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    full_env = dict(env) | {"BATCHSERVE_HOST": "127.0.0.1", "BATCHSERVE_PORT": str(port)}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as output:
        process = subprocess.Popen(
            [part.format(port=port) for part in command],
            env=full_env,
            cwd=cwd,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_ready(process, url, log, ready_timeout_s)
        yield RunningServer(url, process.pid)
    finally:
        stop(process)


@contextlib.contextmanager
def running(
    command: Sequence[str], env: Mapping[str, str], log: Path, ready_timeout_s: float
) -> Iterator[str]:
    """``serving`` in this directory, yielding only the server's URL."""
    with serving(command, env, log, ready_timeout_s) as server:
        yield server.url


def batchserve_command() -> list[str]:
    if not BATCHSERVE.exists():
        raise FileNotFoundError(
            f"{BATCHSERVE} does not exist: install the package (pip install -e '.[dev]')"
        )
    return [str(BATCHSERVE), "serve"]


def module_command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, "--port", "{port}", *args]


def checkout_command(checkout: Path) -> list[str]:
    """``serve`` of another checkout of this project, with this Python (run it in ``checkout``,
    so that its ``service`` package is imported): ``service.server.cli`` where that checkout
    has it, else the older layout's ``service.cli``."""
    if (checkout / "service" / "server" / "cli.py").is_file():
        return [sys.executable, "-m", "service.server.cli", "serve"]
    if (checkout / "service" / "cli.py").is_file():
        return [sys.executable, "-m", "service.cli", "serve"]
    raise FileNotFoundError(
        f"{checkout} has neither service/server/cli.py nor service/cli.py: not a checkout of "
        "batchserve"
    )


def check_answers(url: str, bodies: Sequence[bytes], headers: Mapping[str, str]) -> None:
    """Send a few of the workload's bodies once; raise ServerError unless each gets 200."""
    for body in bodies:
        response = httpx.post(url + "/predict", content=body, headers=dict(headers), timeout=60)
        if response.status_code != 200:
            raise ServerError(
                f"the server answered {response.status_code} to the workload's requests: "
                f"{response.text[:500]}"
            )


_BATCH_ROWS = re.compile(r"^batchserve_batch_size_rows_(sum|count)\s+(\S+)$", re.MULTILINE)


def batch_counters(url: str) -> tuple[float, float] | None:
    """(rows, batches) so far from ``/metrics``; None if the server does not export them."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.TransportError:
        return None
    values = dict(_BATCH_ROWS.findall(text))
    if "sum" not in values or "count" not in values:
        return None
    return float(values["sum"]), float(values["count"])
