"""Resident memory of every process of a server under test, from ``/proc`` (Linux only).

A server with ``workers`` above 1 is several processes, and what it costs in memory is their
sum: one ``VmRSS`` per process (``/proc/<pid>/status``), each named by its role in the tree.
Pages shared after a fork count in every process that maps them, so the sum overstates what
the forked gunicorn workers cost together; each process's own figure is exact. The CPU time
of a tree is read from the same files, to check that servers waiting for their turn are idle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
ENGINE_MODULE = "service.engine.process"
#: The supervisor's spare engine interpreter (``spare_engine``): torch imported, no model yet.
#: One that became an engine keeps this command line, and is counted a spare engine here.
SPARE_MODULE = "service.engine.spare"


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
