"""``batchserve serve --workers 2``: real gunicorn, two real workers, on a free 127.0.0.1 port.

Counts must add up across workers, SIGTERM must drain and exit 0, and a model that cannot load
must stop gunicorn instead of leaving workers that answer 503 forever.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import multiprocess
from prometheus_client.parser import text_string_to_metric_families

from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.processes import (
    BATCHSERVE,
    Running,
    answers,
    batchserve_environment,
    free_port,
    running,
    wait_for,
)

pytestmark = pytest.mark.slow

WORKERS = 2
REQUESTS = 200
CONCURRENCY = 8
LOAD_CAP_S = 30.0
#: An orphaned worker notices within a second, then drains like on SIGTERM.
ORPHAN_EXIT_S = 20.0


def start_workers(tmp_path: Path, **variables: str) -> Running:
    """Enter with ``with``; ready once both workers logged ``model_ready``."""
    port = free_port()
    env = batchserve_environment(port, BATCHSERVE_WORKERS=str(WORKERS), **variables)
    return running([str(BATCHSERVE), "serve"], f"http://127.0.0.1:{port}", tmp_path / "log", env)


def wait_until_every_worker_is_ready(server: Running) -> None:
    wait_for(
        lambda: server.output().count('"event":"model_ready"') == WORKERS,
        f"{WORKERS} workers ready",
        server,
    )
    wait_for(lambda: answers(server.url + "/readyz"), "answering /readyz", server)


@pytest.fixture
def metrics_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "metrics"
    directory.mkdir()
    # A stale file from an earlier run: the launcher must delete it, or its counts would add up.
    (directory / "counter_1.db").write_bytes(b"stale")
    return directory


@pytest.fixture
def workers(tmp_path: Path, metrics_dir: Path) -> Iterator[Running]:
    with start_workers(tmp_path, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)) as server:
        wait_until_every_worker_is_ready(server)
        yield server


def digit_body(seed: int) -> dict[str, object]:
    return {"instances": np.random.default_rng(seed).random((1, 8, 8)).tolist()}


async def send_predictions(url: str, count: int) -> list[httpx.Response]:
    """``count`` predictions from ``CONCURRENCY`` callers, each on a new connection so that
    the kernel hands them to either worker."""
    responses: list[httpx.Response] = []
    sent = 0
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
    started_s = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=10.0, limits=limits) as client:

        async def caller(index: int) -> None:
            nonlocal sent
            while sent < count and time.monotonic() - started_s < LOAD_CAP_S:
                sent += 1
                response = await client.post(
                    "/predict", json=digit_body(index), headers={"connection": "close"}
                )
                responses.append(response)

        await asyncio.gather(*(caller(index) for index in range(CONCURRENCY)))
    return responses


def scraped_value(url: str, name: str, labels: dict[str, str]) -> float:
    text = httpx.get(url + "/metrics", timeout=5.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def predictions_per_worker(metrics_dir: Path) -> dict[int, float]:
    """Successful /predict answers counted in each worker's own counter file."""
    counts: dict[int, float] = {}
    for path in metrics_dir.glob("counter_*.db"):
        pid = int(re.fullmatch(r"counter_(\d+)\.db", path.name).group(1))  # type: ignore[union-attr]
        for metric in multiprocess.MultiProcessCollector.merge([str(path)]):
            for sample in metric.samples:
                if sample.name == "batchserve_requests_total" and sample.labels == {
                    "route": "/predict",
                    "status": "200",
                }:
                    counts[pid] = sample.value
    return counts


def test_requests_are_counted_once_across_workers(workers: Running, metrics_dir: Path) -> None:
    statuses = [r.status_code for r in asyncio.run(send_predictions(workers.url, REQUESTS))]
    assert statuses == [200] * REQUESTS

    labels = {"route": "/predict", "status": "200"}
    assert scraped_value(workers.url, "batchserve_requests_total", labels) == REQUESTS
    assert scraped_value(workers.url, "batchserve_batch_size_rows_sum", {}) == REQUESTS
    assert scraped_value(workers.url, "batchserve_ready", {}) == 1.0
    assert scraped_value(workers.url, "batchserve_in_flight_requests", {}) == 0.0

    per_worker = predictions_per_worker(metrics_dir)
    assert not (metrics_dir / "counter_1.db").exists()
    assert len(per_worker) == WORKERS, f"both workers must serve: {per_worker}"
    assert all(count > 0 for count in per_worker.values()), per_worker
    assert sum(per_worker.values()) == REQUESTS


def test_sigterm_drains_every_worker_and_exits_0(tmp_path: Path) -> None:
    with start_workers(tmp_path, BATCHSERVE_DRAIN_DELAY_S="1.0") as server:
        wait_until_every_worker_is_ready(server)
        metrics_dir = re.search(r'"metrics_dir":"([^"]+)"', server.output())
        assert metrics_dir is not None, "the launcher logs the metrics folder it created"
        assert Path(metrics_dir.group(1)).is_dir()

        statuses, after_sigterm = asyncio.run(load_then_sigterm(server))
        assert statuses, "no request was answered"
        assert set(statuses) == {200}, statuses
        assert after_sigterm > 0, "requests sent while readiness was off must still be served"
        assert server.process.wait(timeout=30) == 0
        assert server.output().count('"event":"shutdown_complete"') == WORKERS
        assert not Path(metrics_dir.group(1)).exists(), "a temporary metrics folder is removed"


async def load_then_sigterm(server: Running) -> tuple[list[int], int]:
    """Closed-loop load; SIGTERM to the master after 50 answers; keep sending until /readyz
    answers 503, as a load balancer would, then stop. Returns statuses and how many answers
    came after SIGTERM."""
    statuses: list[int] = []
    answered_after_sigterm = 0
    stop = asyncio.Event()
    warmed_up = asyncio.Event()
    sigterm_sent = asyncio.Event()
    started_s = time.monotonic()
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15.0) as client,
        httpx.AsyncClient(base_url=server.url, timeout=5.0) as probe,
    ):

        async def caller(index: int) -> None:
            nonlocal answered_after_sigterm
            while not stop.is_set() and time.monotonic() - started_s < LOAD_CAP_S:
                response = await client.post("/predict", json=digit_body(index))
                statuses.append(response.status_code)
                answered_after_sigterm += sigterm_sent.is_set()
                if len(statuses) >= 50:
                    warmed_up.set()

        async def terminate() -> None:
            await asyncio.wait_for(warmed_up.wait(), timeout=LOAD_CAP_S)
            server.process.send_signal(signal.SIGTERM)
            sigterm_sent.set()
            while time.monotonic() - started_s < LOAD_CAP_S:
                if (await probe.get("/readyz")).status_code == 503:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            stop.set()

        await asyncio.gather(terminate(), *(caller(index) for index in range(CONCURRENCY)))
    return statuses, answered_after_sigterm


def test_a_model_that_cannot_load_stops_gunicorn(tmp_path: Path) -> None:
    with start_workers(tmp_path, BATCHSERVE_MODEL_NAME="nosuchmodel") as server:
        wait_for(lambda: server.process.poll() is not None, "stopped", server)
        assert server.process.returncode != 0
        output = server.output()
        assert "model_load_failed" in output
        assert "nosuchmodel" in output


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_workers_drain_and_exit_when_their_master_is_killed(tmp_path: Path) -> None:
    with start_workers(tmp_path) as server:
        wait_until_every_worker_is_ready(server)
        pids = [int(pid) for pid in re.findall(r"Booting worker with pid: (\d+)", server.output())]
        assert len(pids) == WORKERS
        server.process.kill()
        server.process.wait(timeout=10)
        try:
            deadline_s = time.monotonic() + ORPHAN_EXIT_S
            while any(alive(pid) for pid in pids) and time.monotonic() < deadline_s:
                time.sleep(0.1)
            assert not any(alive(pid) for pid in pids), server.output()
            assert server.output().count('"event":"master_gone"') == WORKERS
        finally:
            for pid in filter(alive, pids):
                os.kill(pid, signal.SIGKILL)


def serving_events(server: Running, version: str) -> list[dict[str, object]]:
    """The ``model_serving`` log records (one per worker that started serving) of ``version``."""
    events = []
    for line in server.output().splitlines():
        if '"model_serving"' in line and version in line:
            record = json.loads(line)
            if record["event"] == "model_serving" and record["version"] == version:
                events.append(record)
    return events


def admin_switch(server: Running, token: str, route: str, version: str, events: int) -> None:
    """POST the admin ``route``; wait until ``version`` has ``events`` ``model_serving`` log
    records in all (the worker that answered switches at once, the others at their next
    check); then every answer, on new connections to either worker, must come from it."""
    switched = httpx.post(
        f"{server.url}/admin{route}", headers={"Authorization": f"Bearer {token}"}, timeout=60.0
    )
    assert switched.status_code == 200, switched.text
    wait_for(
        lambda: len(serving_events(server, version)) == events,
        f"every worker serving {version}",
        server,
        timeout_s=30.0,
    )
    responses = asyncio.run(send_predictions(server.url, 40))
    assert {r.headers["x-model-version"] for r in responses} == {f"digits@{version}"}


def test_an_admin_switch_reaches_every_worker_and_their_replacements(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    copy_bundled_digits(repository)
    retrained = add_digits_version(repository, 0.5)
    token = "gunicorn-admin-token-for-tests"
    with start_workers(
        tmp_path,
        BATCHSERVE_MODEL_REPOSITORY=str(repository),
        BATCHSERVE_MODEL_VERSION=DIGITS.version,
        BATCHSERVE_ADMIN_TOKEN=token,
    ) as server:
        wait_until_every_worker_is_ready(server)
        admin_switch(server, token, f"/models/digits/versions/{retrained}/load", retrained, WORKERS)
        info = {"model": "digits", "device": "cpu", "precision": "fp32", "compiled": "False"}
        model_info = "batchserve_model_info"
        assert scraped_value(server.url, model_info, info | {"version": retrained}) == 1
        assert scraped_value(server.url, model_info, info | {"version": DIGITS.version}) == 0

        # A worker started after the switch (here, the replacement for a killed one) serves
        # the switched-to version, not the one in BATCHSERVE_MODEL_VERSION.
        victim = int(re.findall(r"Booting worker with pid: (\d+)", server.output())[0])
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: len(serving_events(server, retrained)) == WORKERS + 1,
            "the replacement worker serving the new version",
            server,
        )
        assert serving_events(server, retrained)[-1]["replaced"] is None

        # Whichever worker answers, the replacement included, rolls every worker back.
        admin_switch(server, token, "/rollback", DIGITS.version, 2 * WORKERS)
