"""Where an engine's restart goes: kill -9 the engine of ``batchserve serve`` several times
under light traffic and read, from the JSON logs, when each step of the way back happened.

    python -m loadtests.restart_timeline --kills 5 --out docs/bench/restart/after.json

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
import json
import os
import signal
import statistics
import subprocess
import sys
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
)


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


def _client(url: str, stop: threading.Event, answers: list[tuple[float, int]]) -> None:
    with httpx.Client(base_url=url, timeout=5.0) as client:
        while not stop.is_set():
            try:
                status = client.post("/predict", json=DIGIT).status_code
            except httpx.TransportError:
                status = 0
            answers.append((time.time(), status))
            time.sleep(PERIOD_S)


def _engine_pids(supervisor: int) -> list[int]:
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    pids = []
    for pid in children:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"service.engine.process" in command:
            pids.append(int(pid))
    return pids


def _wait_serving(answers: list[tuple[float, int]], since: float, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(t > since and s == 200 for t, s in answers[-5:]):
            return
        time.sleep(0.05)
    raise RuntimeError("the server did not answer 200 in time")


def measure(kills: int, settle_s: float, log: Path) -> list[dict[str, float]]:
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
        }
    )
    answers: list[tuple[float, int]] = []
    stop = threading.Event()
    timelines = []
    with log.open("wb") as output:
        server = subprocess.Popen([str(BATCHSERVE), "serve"], env=env, stdout=output, stderr=output)
    client = threading.Thread(target=_client, args=(url, stop, answers))
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.post(url + "/predict", json=DIGIT, timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        client.start()
        for _ in range(kills):
            time.sleep(settle_s)
            (victim,) = _engine_pids(server.pid)
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            _wait_serving(answers, killed, 30.0)
            time.sleep(0.5)  # the last log lines
            timelines.append(_timeline(log, answers, killed))
    finally:
        stop.set()
        if client.is_alive():
            client.join()
        server.terminate()
        server.wait(timeout=30)
    return timelines


def _timeline(log: Path, answers: list[tuple[float, int]], killed: float) -> dict[str, float]:
    events = [(t, name, record) for t, name, record in _events(log) if t >= killed - 0.002]
    line: dict[str, float] = {}
    started = min((t for t, name, _ in events if name == "engine_process_started"), default=0.0)
    for step, event, count in STEPS:
        # A front end may reach the dying engine's socket once more before it closes.
        since = started if event == "engine_connected" else killed
        times = [t for t, name, _ in events if name == event and t >= since][:count]
        if len(times) == count:
            line[step] = round(times[-1] - killed, 3)
    first = next(t for t, status in answers if t > killed and status == 200)
    line["first_answer"] = round(first - killed, 3)
    failed = [t for t, status in answers if killed < t < first]
    line["failed_requests"] = len(failed)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--settle-s", type=float, default=4.0, help="serving time before each kill")
    parser.add_argument("--out", type=Path, default=None, help="write the timelines as JSON")
    parser.add_argument("--log", type=Path, default=None, help="keep the server's log here")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        log = arguments.log or Path(folder) / "server.log"
        timelines = measure(arguments.kills, arguments.settle_s, log)
    steps = [step for step, _, _ in STEPS] + ["first_answer", "failed_requests"]
    for line in timelines:
        print(json.dumps(line))
    medians = {
        step: round(statistics.median(values), 3)
        for step in steps
        if (values := [line[step] for line in timelines if step in line])
    }
    print("median:", json.dumps(medians))
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    if arguments.out is not None:
        arguments.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"timelines": timelines, "median": medians, "load_average": load}
        arguments.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
