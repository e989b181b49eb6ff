"""The real ``batchserve serve`` process on a free 127.0.0.1 port: classify, then drain."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from scripts.train_digits import load_split
from tests.processes import BATCHSERVE, free_port

pytestmark = pytest.mark.slow

LOAD_WORKERS = 32
LOAD_CAP_S = 30.0
DRAIN_DELAY_S = 3.0


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    port = free_port()
    log = tmp_path / "server.log"
    env = os.environ | {
        "BATCHSERVE_PORT": str(port),
        "BATCHSERVE_DEVICE": "cpu",
        "BATCHSERVE_MAX_WAIT_MS": "5",
        # Long enough that the load below stops sending (0.3 s after it sees readiness off)
        # before the listener closes, even when a busy machine delays that probe.
        "BATCHSERVE_DRAIN_DELAY_S": str(DRAIN_DELAY_S),
    }
    with log.open("wb") as output:
        process = subprocess.Popen(
            [str(BATCHSERVE), "serve"], env=env, stdout=output, stderr=subprocess.STDOUT
        )
    running = Server(process=process, url=f"http://127.0.0.1:{port}", log=log)
    try:
        wait_until_ready(running)
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def wait_until_ready(server: Server, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"server exited early:\n{server.log.read_text()}")
        try:
            if httpx.get(server.url + "/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"server not ready after {timeout_s} s:\n{server.log.read_text()}")


def test_classifies_held_out_digits(server: Server) -> None:
    _, test_images, _, test_labels = load_split(seed=0)
    predicted: list[int] = []
    with httpx.Client(base_url=server.url, timeout=10.0) as client:
        for start in range(0, len(test_images), 40):
            batch = test_images[start : start + 40]
            response = client.post("/predict", json={"instances": batch.tolist()})
            assert response.status_code == 200
            predicted.extend(np.argmax(response.json()["predictions"], axis=1).tolist())
    accuracy = float(np.mean(np.array(predicted) == test_labels))
    assert accuracy >= 0.95


def test_sigterm_under_load_answers_every_accepted_request(server: Server) -> None:
    outcomes, sigterm_at, ready_off_at = asyncio.run(load_then_sigterm(server))
    failures = [outcome for outcome in outcomes if outcome[1] != 200]
    assert failures == [], f"{len(failures)} of {len(outcomes)} requests failed: {failures[:5]}"
    served_while_draining = [outcome for outcome in outcomes if outcome[0] > sigterm_at]
    assert served_while_draining, "requests sent after SIGTERM must still be served during drain"
    assert ready_off_at - sigterm_at < 1.0, "readiness must turn 503 promptly after SIGTERM"
    assert server.process.wait(timeout=30) == 0
    log = server.log.read_text()
    assert '"event":"shutdown_complete"' in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/healthz", timeout=1.0)


async def load_then_sigterm(server: Server) -> tuple[list[tuple[float, int | str]], float, float]:
    """Closed-loop load; SIGTERM after 200 answers; stop sending once /readyz says 503.

    That is what a load balancer does: it stops routing to a pod whose readiness fails.
    """
    outcomes: list[tuple[float, int | str]] = []
    stop_sending = asyncio.Event()
    images = np.random.default_rng(0).random((LOAD_WORKERS, 8, 8)).tolist()
    limits = httpx.Limits(max_connections=LOAD_WORKERS)
    started = time.monotonic()
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15.0, limits=limits) as client,
        httpx.AsyncClient(base_url=server.url, timeout=5.0) as probe,
    ):
        warmed_up = asyncio.Event()
        not_ready = asyncio.Event()
        each_sent_while_not_ready: set[int] = set()
        each_served_while_not_ready = asyncio.Event()

        async def worker(index: int) -> None:
            body = {"instances": [images[index]]}
            while not stop_sending.is_set() and time.monotonic() - started < LOAD_CAP_S:
                sent_late = not_ready.is_set()
                try:
                    response = await client.post("/predict", json=body)
                    outcomes.append((time.monotonic(), response.status_code))
                except httpx.HTTPError as error:
                    outcomes.append((time.monotonic(), type(error).__name__))
                if sent_late:
                    each_sent_while_not_ready.add(index)
                    if len(each_sent_while_not_ready) == LOAD_WORKERS:
                        each_served_while_not_ready.set()
                if len(outcomes) >= 200:
                    warmed_up.set()

        async def terminate() -> tuple[float, float]:
            await asyncio.wait_for(warmed_up.wait(), timeout=LOAD_CAP_S)
            server.process.send_signal(signal.SIGTERM)
            sigterm_at = time.monotonic()
            while time.monotonic() - started < LOAD_CAP_S:
                if (await probe.get("/readyz")).status_code == 503:
                    break
                await asyncio.sleep(0.01)
            ready_off_at = time.monotonic()
            not_ready.set()
            # Keep sending while readiness is off, until every worker has had a request sent
            # since answered (those must be served too), within the drain delay.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(each_served_while_not_ready.wait(), DRAIN_DELAY_S / 2)
            stop_sending.set()
            return sigterm_at, ready_off_at

        timing, *_ = await asyncio.gather(terminate(), *(worker(i) for i in range(LOAD_WORKERS)))
    return outcomes, timing[0], timing[1]
