"""Where an engine's restart goes: kill -9 the engine of ``batchserve serve`` several times
under light traffic and read, from the JSON logs, when each step of the way back happened.

    python -m loadtests.restart_timeline --kills 5 --out after.json
    python -m loadtests.restart_timeline --standby 1 --clients 8 --kills 2 --settle-s 10
    python -m loadtests.restart_timeline --standby 1 --clients 8 --kills 2 --signal stop
    python -m loadtests.restart_timeline --kills 2 --settle-s 31 --no-spare

With ``--standby N`` the server keeps N warm standby engines and the fault goes to the active
engine (``--signal kill``: kill -9; ``stop``: SIGSTOP, a hung engine); before each fault the
harness waits until a standby is ready again, then ``--settle-s`` more. Every answer is
checked against the model's answer alone (a lone request before the load), and for each
fault it reports the answers other than 200, the longest gap between two answers 200, and
when the front ends switched (``engine_failover``). The server keeps its spare engine
interpreter (``spare_engine``, on by default; ``--no-spare`` turns it off), so the new engine
is usually the spare: its step "imported" is when it was told to become the engine.

One client sends a digits request every 20 ms (closed loop) to a server with two front ends
and one CPU engine. For each kill the steps, in seconds after the kill: the supervisor notices
(``engine_exited``), starts the new process, the process has imported everything
(``engine_imports_done``), the model is loaded and warmed up (``model_warmed_up``), ready
(``model_ready``), the last front end has reconnected (``engine_connected``) and the first
answer 200 arrives. Medians over the kills are printed. The machine's load changes these
figures: run it on a quiet machine, or say how loaded yours was.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

from loadtests.servers import BATCHSERVE, free_port, server_env

DIGIT = {"instances": [[[0.5] * 8] * 8]}
PERIOD_S = 0.02
STEPS = (
    ("noticed", "engine_exited", 1),
    ("process_started", "engine_process_started", 1),
    ("imported", "engine_imports_done", 1),
    ("warmed", "model_warmed_up", 1),
    ("ready", "model_ready", 1),
    ("reconnected", "engine_connected", 2),
    ("failover", "engine_failover", 2),
)
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def _events(log: Path) -> list[tuple[float, str, dict[str, object]]]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        stamp = datetime.fromisoformat(record["ts"]).timestamp()
        found.append((stamp, str(record.get("event")), record))
    return found


def _client(
    url: str,
    stop: threading.Event,
    answers: list[tuple[float, int, float]],
    period_s: float,
    reference: list[float],
    mismatches: list[float],
) -> None:
    with httpx.Client(base_url=url, timeout=30.0) as client:
        while not stop.is_set():
            sent = time.time()
            try:
                response = client.post("/predict", json=DIGIT)
                status = response.status_code
            except httpx.TransportError:
                status = 0
            answers.append((time.time(), status, sent))
            if status == 200 and not _equal(response.json()["predictions"][0], reference):
                mismatches.append(time.time())
            time.sleep(period_s if status == 200 else max(period_s, 0.05))


def _equal(got: list[float], expected: list[float]) -> bool:
    return all(abs(a - b) <= 1e-5 + 1e-5 * abs(b) for a, b in zip(got, expected, strict=True))


def _active_engine(url: str) -> tuple[int, int]:
    """The active engine's pid, and how many standbys are ready."""
    engines = httpx.get(url + "/models", timeout=10.0).json()["engines"]
    roles = [(engine["role"], engine["pid"]) for engine in engines]
    (active,) = [pid for role, pid in roles if role == "active"]
    return int(active), sum(role == "standby" for role, _ in roles)


def engine_memory_mib(url: str, supervisor: int | None = None) -> list[dict[str, object]]:
    """Each engine's role and memory (resident, and proportional: shared pages split among the
    processes that map them), from /proc; with ``supervisor``, its spare engine interpreter's
    too (role ``spare``)."""
    engines = httpx.get(url + "/models", timeout=10.0).json()["engines"]
    roles = {int(engine["pid"]): str(engine["role"]) for engine in engines if engine["pid"]}
    if supervisor is not None:
        children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
        for child in map(int, children):
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{child}/cmdline").read_bytes()
                if b"service.engine.spare" in command and child not in roles:
                    roles[child] = "spare"
    found: list[dict[str, object]] = []
    for pid, role in roles.items():
        fields = {}
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) / 1024
        found.append(
            {"role": role, "rss_mib": round(fields["Rss"]), "pss_mib": round(fields["Pss"])}
        )
    return found


def _wait_for_spare(log: Path, timeout_s: float) -> None:
    """Wait until the spare engine interpreter has done its imports (its memory is then what
    it keeps)."""
    deadline_s = time.monotonic() + timeout_s
    while '"event":"spare_engine_ready"' not in log.read_text(errors="replace"):
        if time.monotonic() > deadline_s:
            raise RuntimeError("no spare engine interpreter was ready in time")
        time.sleep(0.1)


def _wait_for_standby(url: str, timeout_s: float) -> float:
    """Wait until a standby is ready; the seconds waited."""
    started_s = time.monotonic()
    while time.monotonic() - started_s < timeout_s:
        try:
            if _active_engine(url)[1] > 0:
                return time.monotonic() - started_s
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError("no standby engine was ready in time")


def _wait_serving(answers: list[tuple[float, int, float]], since: float, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(sent > since and s == 200 for _, s, sent in answers[-5:]):
            return
        time.sleep(0.05)
    raise RuntimeError("the server did not answer 200 in time")


def measure(
    kills: int,
    settle_s: float,
    log: Path,
    standby: int = 0,
    clients: int = 1,
    fault: str = "kill",
    memory: list[dict[str, object]] | None = None,
    spare: bool = True,
) -> list[dict[str, float]]:
    """The timeline of each fault; each engine's memory before the first into ``memory``."""
    memory = [] if memory is None else memory
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = server_env(
        {
            "BATCHSERVE_HOST": "127.0.0.1",
            "BATCHSERVE_PORT": str(port),
            "BATCHSERVE_DEVICE": "cpu",
            "BATCHSERVE_TORCH_THREADS": "1",
            "BATCHSERVE_WORKERS": "2",
            "BATCHSERVE_ENGINE_MODE": "process",
            "BATCHSERVE_STANDBY_ENGINES": str(standby),
            "BATCHSERVE_SPARE_ENGINE": "true" if spare else "false",
        }
    )
    answers: list[tuple[float, int, float]] = []
    stop = threading.Event()
    timelines = []
    with log.open("wb") as output:
        server = subprocess.Popen([str(BATCHSERVE), "serve"], env=env, stdout=output, stderr=output)
    mismatches: list[float] = []
    period_s = PERIOD_S if clients == 1 else 0.0  # several clients: a closed loop
    threads: list[threading.Thread] = []
    try:
        deadline = time.time() + 120
        reference: list[float] = []
        while time.time() < deadline and not reference:
            try:
                response = httpx.post(url + "/predict", json=DIGIT, timeout=2.0)
                if response.status_code == 200:
                    reference = response.json()["predictions"][0]
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        threads = [
            threading.Thread(
                target=_client, args=(url, stop, answers, period_s, reference, mismatches)
            )
            for _ in range(clients)
        ]
        for thread in threads:
            thread.start()
        if standby:
            _wait_for_standby(url, 300.0)
        if spare:
            _wait_for_spare(log, 300.0)
        memory.extend(engine_memory_mib(url, server.pid))
        for _ in range(kills):
            waited_s = _wait_for_standby(url, 300.0) if standby else 0.0
            time.sleep(settle_s)
            # As the front ends see it: an engine started from the spare engine interpreter
            # runs ``service.engine.spare``, not ``service.engine.process``.
            victim = _active_engine(url)[0]
            killed = time.time()
            os.kill(victim, SIGNALS[fault])
            _wait_serving(answers, killed, 30.0)
            time.sleep(2.0 if standby else 0.5)  # the last log lines; answers after the gap
            line = _timeline(log, answers, killed)
            line["mismatches"] = len(mismatches)  # since the start
            line["requests_so_far"] = len(answers)
            line["refused_so_far"] = sum(status != 200 for _, status, _ in answers)
            line["waited_for_standby_s"] = round(waited_s, 3)
            timelines.append(line)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        server.terminate()
        server.wait(timeout=30)
    return timelines


def _timeline(
    log: Path, answers: list[tuple[float, int, float]], killed: float
) -> dict[str, float]:
    events = [(t, name, record) for t, name, record in _events(log) if t >= killed - 0.002]
    line: dict[str, float] = {}
    started = min((t for t, name, _ in events if name == "engine_process_started"), default=0.0)
    for step, event, count in STEPS:
        # A front end may reach the dying engine's socket once more before it closes.
        since = started if event == "engine_connected" else killed
        times = [t for t, name, _ in events if name == event and t >= since][:count]
        if len(times) == count:
            line[step] = round(times[-1] - killed, 3)
    # A request sent after the kill: one the dead engine answered just before it died may reach
    # the client just after.
    first = next(t for t, status, sent in answers if sent > killed and status == 200)
    line["first_answer"] = round(first - killed, 3)
    failed = [t for t, status, _ in answers if killed < t < first and status != 200]
    line["failed_requests"] = len(failed)
    around = [(t, status) for t, status, _ in answers if killed - 1.0 < t <= killed + 2.0]
    line["refused"] = sum(status != 200 for _, status in around)
    line["answered"] = sum(status == 200 for _, status in around)
    served = [t for t, status in around if status == 200]
    gaps_s = [b - a for a, b in itertools.pairwise(served)]
    line["longest_gap_s"] = round(max(gaps_s, default=0.0), 3)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--settle-s", type=float, default=4.0, help="serving time before each kill")
    parser.add_argument("--out", type=Path, default=None, help="write the timelines as JSON")
    parser.add_argument("--log", type=Path, default=None, help="keep the server's log here")
    parser.add_argument("--standby", type=int, default=0, help="BATCHSERVE_STANDBY_ENGINES")
    parser.add_argument("--clients", type=int, default=1, help="more than 1: a closed loop")
    parser.add_argument("--signal", choices=sorted(SIGNALS), default="kill")
    parser.add_argument(
        "--no-spare", action="store_true", help="BATCHSERVE_SPARE_ENGINE=false (on by default)"
    )
    arguments = parser.parse_args()
    memory: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as folder:
        log = arguments.log or Path(folder) / "server.log"
        timelines = measure(
            arguments.kills,
            arguments.settle_s,
            log,
            standby=arguments.standby,
            clients=arguments.clients,
            fault=arguments.signal,
            memory=memory,
            spare=not arguments.no_spare,
        )
    steps = [step for step, _, _ in STEPS] + [
        "first_answer",
        "failed_requests",
        "refused",
        "answered",
        "longest_gap_s",
        "mismatches",
    ]
    for line in timelines:
        print(json.dumps(line))
    medians = {
        step: round(statistics.median(values), 3)
        for step in steps
        if (values := [line[step] for line in timelines if step in line])
    }
    print("median:", json.dumps(medians))
    print("engine memory (MiB):", json.dumps(memory))
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    if arguments.out is not None:
        arguments.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "settings": {
                "standby": arguments.standby,
                "clients": arguments.clients,
                "signal": arguments.signal,
                "settle_s": arguments.settle_s,
                "spare": not arguments.no_spare,
            },
            "timelines": timelines,
            "median": medians,
            "engine_memory_mib": memory,
            "load_average": load,
        }
        arguments.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
