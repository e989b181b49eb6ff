"""The server processes under test, all on 127.0.0.1: start, wait for and stop them, read
their ``/metrics``, and their processes' memory and CPU time from ``/proc`` (Linux only).

A server with ``workers`` above 1 is several processes, and what it costs in memory is their
sum: one ``VmRSS`` per process (``/proc/<pid>/status``), each named by its role in the tree.
Pages shared after a fork count in every process that maps them, so the sum overstates what
the forked gunicorn workers cost together; each process's own figure is exact. The CPU time
of a tree is read from the same files: what a server used per answered request, and whether
servers waiting for their turn are idle.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from service.config import ENV_PREFIX

BATCHSERVE = Path(sys.executable).with_name("batchserve")
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
PROC = Path("/proc")
ENGINE_MODULE = "service.engine.process"
#: The supervisor's spare engine interpreter (``spare_engine``): torch imported, no model yet.
#: One that became an engine keeps this command line, and is counted a spare engine here.
SPARE_MODULE = "service.engine.spare"


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
    process: subprocess.Popen[bytes] | None = field(default=None, compare=False, repr=False)

    def exit_status(self) -> int | None:
        """The process's exit status if it has ended, else None (also when not ours to poll)."""
        return None if self.process is None else self.process.poll()


def start(
    command: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    cwd: Path | None = None,
    *,
    new_session: bool = False,
) -> RunningServer:
    """Start ``command`` on a free 127.0.0.1 port without waiting for it to be ready.

    ``command`` may contain ``{port}``; it also gets ``BATCHSERVE_HOST``/``BATCHSERVE_PORT``.
    ``new_session`` makes it the leader of its own process group, so that whatever it leaves
    behind can be found and killed by that group (``stop_all``).
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
            start_new_session=new_session,
        )
    return RunningServer(url, process.pid, process)


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
    server = start(command, env, log, cwd)
    assert server.process is not None
    try:
        wait_ready(server.process, server.url, log, ready_timeout_s)
        yield server
    finally:
        stop(server.process)


def stop_all(started: Sequence[RunningServer], timeout_s: float = 30.0) -> None:
    """Stop servers started with ``new_session``: SIGTERM to all at once, then wait for all.

    Sent together, the servers shut down in parallel rather than one after another. Whatever
    has not ended by ``timeout_s``, or is still waited for when this is interrupted (a second
    Ctrl-C), is killed, and so is anything left in their process groups: orphaned children.
    """
    processes = [server.process for server in started if server.process is not None]
    try:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + timeout_s
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
            # The group is named by the leader's id, which Linux does not hand out again while
            # any process of the group lives: only this server's own leftovers are killed.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)


class ServerPool:
    """Servers started one after another and kept running together, for interleaved runs.

    Each is the leader of its own process group. Closing the pool (leaving its ``with`` block,
    on an exception or Ctrl-C too) stops every server it started, ready or not.
    """

    def __init__(self) -> None:
        self.started: list[RunningServer] = []

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        ready_timeout_s: float,
        cwd: Path | None = None,
    ) -> RunningServer:
        """Start a server and wait until it is ready; ServerError (and stopped) if it is not."""
        server = start(command, env, log, cwd, new_session=True)
        self.started.append(server)  # before waiting: a Ctrl-C while it loads must stop it too
        assert server.process is not None
        try:
            wait_ready(server.process, server.url, log, ready_timeout_s)
        except Exception:
            self.stop(server)
            raise
        return server

    def stop(self, server: RunningServer) -> None:
        """Stop one server of the pool now (one that failed), leaving the others running."""
        stop_all([server])
        self.started.remove(server)

    def close(self) -> None:
        started, self.started = self.started, []
        stop_all(started)


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


#: Unlabelled (older servers) or one series per model.
def batch_counters(url: str) -> tuple[float, float] | None:
    """(rows, batches) so far from ``/metrics``, over every model; None if the server does
    not export them."""
    return histogram_totals(url, "batchserve_batch_size_rows")


def _metrics_text(url: str) -> str | None:
    """The server's ``/metrics`` page, or None if it cannot be read."""
    try:
        return httpx.get(url + "/metrics", timeout=10).text
    except httpx.TransportError:
        return None


def histogram_totals(url: str, name: str) -> tuple[float, float] | None:
    """(sum, count) so far of ``/metrics``'s histogram ``name``, over its labels; None if the
    server does not export it."""
    text = _metrics_text(url)
    return None if text is None else parse_histogram_totals(text, name)


def parse_histogram_totals(text: str, name: str) -> tuple[float, float] | None:
    """``histogram_totals`` of a ``/metrics`` page's text."""
    pattern = re.compile(rf"^{re.escape(name)}_(sum|count)(?:\{{[^}}]*\}})?\s+(\S+)$", re.MULTILINE)
    totals: dict[str, float] = {}
    for kind, value in pattern.findall(text):
        totals[kind] = totals.get(kind, 0.0) + float(value)
    if "sum" not in totals or "count" not in totals:
        return None
    return totals["sum"], totals["count"]


_DROPPED = re.compile(
    r'^batchserve_dropped_requests_total\{[^}]*reason="([a-z_]+)"[^}]*\} ([0-9.e+]+)$', re.M
)


def dropped_by_reason(url: str) -> dict[str, float]:
    """Requests dropped so far, by ``reason`` (``batchserve_dropped_requests_total``), over
    every model; empty if the server does not export them."""
    text = _metrics_text(url)
    if text is None:
        return {}
    totals: dict[str, float] = {}
    for reason, value in _DROPPED.findall(text):
        totals[reason] = totals.get(reason, 0.0) + float(value)
    return totals


def histogram_buckets(url: str, name: str) -> dict[float, float] | None:
    """Observations so far of at most ``le``, for each bucket edge of ``/metrics``'s histogram
    ``name``, summed over its labels; None if not exported."""
    text = _metrics_text(url)
    return None if text is None else parse_histogram_buckets(text, name)


def parse_histogram_buckets(text: str, name: str) -> dict[float, float] | None:
    """``histogram_buckets`` of a ``/metrics`` page's text."""
    pattern = re.compile(
        rf'^{re.escape(name)}_bucket\{{(?:[^}}]*,)?le="([^"]+)"[^}}]*\}}\s+(\S+)$', re.MULTILINE
    )
    counts: dict[float, float] = {}
    for edge, value in pattern.findall(text):
        counts[float(edge)] = counts.get(float(edge), 0.0) + float(value)
    return counts or None


def bucket_bound(
    before: dict[float, float] | None, after: dict[float, float] | None, quantile: float
) -> float | None:
    """Upper edge of the bucket holding ``quantile`` of the observations made between two
    ``histogram_buckets`` readings (1.0: the bucket of the largest); None without any."""
    if after is None:
        return None
    before = before or {}
    edges = sorted(after)
    total = after[edges[-1]] - before.get(edges[-1], 0.0)
    if total <= 0:
        return None
    return next(e for e in edges if after[e] - before.get(e, 0.0) >= quantile * total)


# ----------------------------------------------------------- processes, from /proc


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    role: str
    """server (one process), supervisor, engine, spare engine, gunicorn master, gunicorn
    worker or other."""
    rss_bytes: int
    command: str


def _is_gunicorn(command: str) -> bool:
    return any(arg == "gunicorn" or arg.endswith("/gunicorn") for arg in command.split())


def roles(root: int, parents: Mapping[int, int], commands: Mapping[int, str]) -> dict[int, str]:
    """The role of ``root`` and each of its descendants, from who started whom and how.

    gunicorn's workers are forks of its master, with the same command line: a gunicorn
    process whose parent is gunicorn is a worker. ``root`` is the server itself when it runs
    alone, and a supervisor when it started engines or gunicorn (the older layout's
    ``batchserve serve --workers N`` replaced itself with gunicorn's master instead).
    """
    found: dict[int, str] = {}
    for pid in descendants(root, parents):
        command = commands.get(pid, "")
        if ENGINE_MODULE in command.split():
            found[pid] = "engine"
        elif SPARE_MODULE in command.split():
            found[pid] = "spare engine"
        elif _is_gunicorn(command):
            parent_command = commands.get(parents.get(pid, -1), "")
            worker = pid != root and _is_gunicorn(parent_command)
            found[pid] = "gunicorn worker" if worker else "gunicorn master"
        else:
            found[pid] = "other"
    if found[root] == "other":
        started_servers = any(role != "other" for pid, role in found.items() if pid != root)
        found[root] = "supervisor" if started_servers else "server"
    return found


def descendants(root: int, parents: Mapping[int, int]) -> list[int]:
    """``root`` and every process below it, parents before children."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree = [root]
    for pid in tree:  # grows while it is walked; each pid has one parent, so it ends
        tree += sorted(children.get(pid, []))
    return tree


def _stat(pid: int, proc: Path) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command: state, ppid, ... (``man 5 proc``)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (command) state ppid ...": the command may hold spaces and parentheses.
    return stat[stat.rindex(")") + 1 :].split()


def _parent(pid: int, proc: Path) -> int | None:
    fields = _stat(pid, proc)
    return None if fields is None else int(fields[1])


def _parents(proc: Path) -> dict[int, int]:
    parents = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            parent = _parent(int(entry.name), proc)
            if parent is not None:
                parents[int(entry.name)] = parent
    return parents


def _rss_bytes(pid: int, proc: Path) -> int | None:
    try:
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            assert unit == "kB", line
            return int(value) * 1024
    return None  # a zombie, or a kernel thread


def _command(pid: int, proc: Path) -> str:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def tree_memory(root: int, proc: Path = PROC) -> list[ProcessMemory]:
    """``VmRSS`` of ``root`` and its descendants now, with their roles (gone ones skipped)."""
    parents = _parents(proc)
    tree = descendants(root, parents)
    commands = {pid: _command(pid, proc) for pid in tree}
    found = roles(root, parents, commands)
    measured = []
    for pid in tree:
        rss = _rss_bytes(pid, proc)
        if rss is not None:
            measured.append(ProcessMemory(pid, found[pid], rss, commands[pid]))
    return measured


def settled_tree_memory(
    root: int, quiet_s: float = 2.0, longest_s: float = 10.0, proc: Path = PROC
) -> list[ProcessMemory]:
    """``tree_memory`` once the tree's processes and roles have not changed for ``quiet_s``
    (at most ``longest_s``): a server just ready may still be starting a process (the
    supervisor's spare engine interpreter starts once the engines are ready)."""
    deadline_s = time.monotonic() + longest_s
    processes = tree_memory(root, proc)
    shape = sorted((p.pid, p.role) for p in processes)
    unchanged_since_s = time.monotonic()
    while time.monotonic() < deadline_s:
        time.sleep(0.1)
        processes = tree_memory(root, proc)
        now_shape = sorted((p.pid, p.role) for p in processes)
        if now_shape != shape:
            shape, unchanged_since_s = now_shape, time.monotonic()
        elif time.monotonic() - unchanged_since_s >= quiet_s:
            break
    return processes


def trees_cpu_seconds(roots: Sequence[int], proc: Path = PROC) -> dict[int, float]:
    """User plus system CPU seconds so far of each root's process tree, from one look at
    ``/proc``: the difference between two calls is what the servers used in between, which
    tells whether a server left idle (waiting for its turn) really idles.

    Only processes alive now count: a tree whose process ended in between seems to shrink.
    """
    parents = _parents(proc)
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    used = {}
    for root in roots:
        ticks = 0
        for pid in descendants(root, parents):
            fields = _stat(pid, proc)
            if fields is not None:
                ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
        used[root] = ticks / ticks_per_s
    return used
