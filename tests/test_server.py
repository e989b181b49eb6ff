"""``batchserve serve --workers 2``: a real supervisor, engine process and two gunicorn front
ends on a free 127.0.0.1 port.

One engine batches for both front ends; counts add up once across processes; SIGTERM drains
the front ends, then the engine, and exits 0; a model that cannot load stops the server; the
front ends, gunicorn's master and the supervisor never import torch; an admin switch reaches
every engine or none.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.processes import (
    REPOSITORY_ROOT,
    Running,
    alive,
    children_of,
    engine_pids,
    frontend_pids,
    scraped,
    serve_with_engines,
    wait_for,
    wait_until_serving,
)

pytestmark = pytest.mark.slow

WORKERS = 2
REQUESTS = 300
CONCURRENCY = 16
LOAD_CAP_S = 30.0
CALLERS = 8
DRAIN_DELAY_S = 1.0
TOKEN = "server-admin-token-for-tests"


@pytest.fixture
def metrics_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "metrics"
    directory.mkdir()
    # A stale file from an earlier run: the server must delete it, or its counts would add up.
    (directory / "counter_1.db").write_bytes(b"stale")
    return directory


@pytest.fixture
def server(tmp_path: Path, metrics_dir: Path) -> Iterator[Running]:
    with serve_with_engines(tmp_path, WORKERS, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)) as s:
        wait_until_serving(s, WORKERS)
        yield s


def digits(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((count, 8, 8), dtype=np.float32)


async def predictions(url: str, inputs: list[np.ndarray]) -> list[httpx.Response]:
    """Each input as one request, ``CONCURRENCY`` at a time, each on a new connection so
    that the kernel spreads them over both front ends."""
    responses: list[httpx.Response | None] = [None] * len(inputs)
    next_index = 0
    started_s = time.monotonic()
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=10.0, limits=limits) as client:

        async def caller() -> None:
            nonlocal next_index
            while next_index < len(inputs) and time.monotonic() - started_s < LOAD_CAP_S:
                index = next_index
                next_index += 1
                responses[index] = await client.post(
                    "/predict",
                    json={"instances": inputs[index].tolist()},
                    headers={"connection": "close"},
                )

        await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))
    answered = [response for response in responses if response is not None]
    assert len(answered) == len(inputs), "the load was cut off by its time cap"
    return answered


def reference(inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The digits model run in this process on each input alone (no batching)."""
    import torch

    from service.config import BUNDLED_MODEL_REPOSITORY
    from service.engine.model_store import ModelStore

    module = ModelStore(BUNDLED_MODEL_REPOSITORY).load("digits", DIGITS.version).module
    with torch.inference_mode():
        return [module(torch.from_numpy(instance)).numpy() for instance in inputs]


def test_every_caller_gets_its_own_rows_from_batches_shared_by_both_front_ends(
    server: Running, metrics_dir: Path
) -> None:
    inputs = [digits(1 + index % 3, seed=index) for index in range(REQUESTS)]
    responses = asyncio.run(predictions(server.url, inputs))

    for expected, response in zip(reference(inputs), responses, strict=True):
        assert response.status_code == 200, response.text
        # Distinct random inputs differ by far more than 1e-5: any mix-up fails this.
        np.testing.assert_allclose(response.json()["predictions"], expected, rtol=1e-5, atol=1e-5)

    rows = sum(len(instance) for instance in inputs)
    predict_200 = {"route": "/predict", "status": "200"}
    assert scraped(server.url, "batchserve_requests_total", predict_200) == REQUESTS
    assert scraped(server.url, "batchserve_batch_size_rows_sum") == rows
    assert scraped(server.url, "batchserve_ready") == 1.0
    assert scraped(server.url, "batchserve_engines_ready") == 1.0
    assert scraped(server.url, "batchserve_in_flight_requests") == 0.0
    assert not (metrics_dir / "counter_1.db").exists()
    # What the engine recorded: batches holding requests of both front ends.
    batches = scraped(server.url, "batchserve_batch_frontends_count")
    from_one = scraped(server.url, "batchserve_batch_frontends_bucket", {"le": "1.0"})
    assert batches < REQUESTS / 2, "requests should have been batched together"
    assert batches - from_one > 0, "no batch held rows from both front ends"
    assert scraped(server.url, "batchserve_batch_frontends_bucket", {"le": "2.0"}) == batches


def test_two_device_instances_answer_every_caller_its_own_rows(tmp_path: Path) -> None:
    """Two instances: the requests the front ends hold are split into a batch an instance,
    run at once on two device threads (``Dispatch.split_rows``); each caller still gets
    exactly its own rows."""
    inputs = [digits(1 + index % 3, seed=1000 + index) for index in range(120)]
    with serve_with_engines(tmp_path, WORKERS, BATCHSERVE_DEVICE_INSTANCES="2") as server:
        wait_until_serving(server, WORKERS)
        responses = asyncio.run(predictions(server.url, inputs))
        batches = scraped(server.url, "batchserve_batch_size_rows_count")
    for expected, response in zip(reference(inputs), responses, strict=True):
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(response.json()["predictions"], expected, rtol=1e-5, atol=1e-5)
    assert batches < len(inputs), "requests should have been batched together"


def test_the_front_ends_and_the_supervisor_never_load_torch(server: Running) -> None:
    engines = engine_pids(server)
    front_ends = frontend_pids(server)
    assert len(engines) == 1
    assert len(front_ends) == WORKERS
    gunicorn_masters = [
        pid
        for pid in children_of(server.process.pid)
        if b"gunicorn" in Path(f"/proc/{pid}/cmdline").read_bytes()  # not the spare engine
    ]
    assert len(gunicorn_masters) == 1

    def maps_torch(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    assert maps_torch(engines[0])
    for pid in [server.process.pid, *gunicorn_masters, *front_ends]:
        assert not maps_torch(pid), f"process {pid} loaded torch"


def test_sigterm_drains_front_ends_then_the_engine_and_exits_0(tmp_path: Path) -> None:
    drain_delay = str(DRAIN_DELAY_S)
    with serve_with_engines(tmp_path, WORKERS, BATCHSERVE_DRAIN_DELAY_S=drain_delay) as server:
        wait_until_serving(server, WORKERS)
        statuses, while_not_ready = asyncio.run(load_then_sigterm(server))
        assert statuses, "no request was answered"
        assert set(statuses) == {200}, statuses
        assert while_not_ready > 0, "requests sent while readiness was off must still be served"
        assert server.process.wait(timeout=60) == 0
        output = server.output()
        front_ends_done = output.index('"event":"Shutting down: Master"')
        assert output.index('"event":"shutdown_complete"') > front_ends_done
        assert '"event":"supervisor_stopped"' in output
        # Issue 37.4: a normal stop logged "Error while closing socket [Errno 9]" (at info)
        # and an engine_connection_lost warning from each front end.
        assert "Error while closing socket" not in output
        troubles = [line for line in output.splitlines() if not logged_below_warning(line)]
        assert not troubles, "\n".join(troubles)


def logged_below_warning(line: str) -> bool:
    """Whether ``line`` is a JSON log record at a level below warning (anything else, such
    as a traceback on stderr, is not)."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return isinstance(record, dict) and record.get("level") in ("debug", "info")


async def load_then_sigterm(server: Running) -> tuple[list[int], int]:
    """Closed-loop load; SIGTERM to the supervisor after 50 answers; keep sending until
    /readyz answers 503, as a load balancer would, and a little longer (an answer for each
    caller to a request sent since), then stop. Returns statuses and how many requests sent
    while readiness was off were answered."""
    statuses: list[int] = []
    sent_while_not_ready = 0
    stop = asyncio.Event()
    warmed_up = asyncio.Event()
    not_ready = asyncio.Event()
    each_served_while_not_ready = asyncio.Event()
    started_s = time.monotonic()
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15.0) as client,
        httpx.AsyncClient(base_url=server.url, timeout=5.0) as probe,
    ):

        async def caller(index: int) -> None:
            nonlocal sent_while_not_ready
            while not stop.is_set() and time.monotonic() - started_s < LOAD_CAP_S:
                body = {"instances": digits(1, index).tolist()}
                sent_late = not_ready.is_set()
                response = await client.post("/predict", json=body)
                statuses.append(response.status_code)
                sent_while_not_ready += sent_late
                if sent_while_not_ready >= CALLERS:
                    each_served_while_not_ready.set()
                if len(statuses) >= 50:
                    warmed_up.set()

        async def terminate() -> None:
            await asyncio.wait_for(warmed_up.wait(), timeout=LOAD_CAP_S)
            server.process.send_signal(signal.SIGTERM)
            while time.monotonic() - started_s < LOAD_CAP_S:
                if (await probe.get("/readyz")).status_code == 503:
                    break
                await asyncio.sleep(0.05)
            not_ready.set()
            # As many answers to requests sent since readiness turned off as there are callers,
            # within the drain delay: then stop, as a load balancer would.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(each_served_while_not_ready.wait(), DRAIN_DELAY_S / 2)
            stop.set()

        await asyncio.gather(terminate(), *(caller(index) for index in range(CALLERS)))
    return statuses, sent_while_not_ready


def test_a_model_that_cannot_load_stops_the_server(tmp_path: Path) -> None:
    with serve_with_engines(tmp_path, WORKERS, BATCHSERVE_MODEL_NAME="nosuchmodel") as server:
        wait_for(lambda: server.process.poll() is not None, "stopped", server)
        assert server.process.returncode == 1
        output = server.output()
        assert "model_load_failed" in output
        assert "engine_cannot_load_model" in output
        assert "nosuchmodel" in output


def test_every_process_exits_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    with serve_with_engines(tmp_path, WORKERS) as server:
        wait_until_serving(server, WORKERS)
        children = [*engine_pids(server), *frontend_pids(server)]
        server.process.kill()
        server.process.wait(timeout=10)
        try:
            deadline_s = time.monotonic() + 30.0
            while any(alive(pid) for pid in children) and time.monotonic() < deadline_s:
                time.sleep(0.1)
            assert not any(alive(pid) for pid in children), server.output()
        finally:
            for pid in filter(alive, children):
                os.kill(pid, signal.SIGKILL)


def switch(url: str, route: str) -> httpx.Response:
    return httpx.post(
        f"{url}/admin{route}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120.0
    )


def served_versions(url: str) -> set[str]:
    responses = asyncio.run(predictions(url, [digits(1, seed) for seed in range(40)]))
    return {response.headers["x-model-version"] for response in responses}


def test_an_admin_switch_reaches_both_engines_or_neither(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    copy_bundled_digits(repository)
    retrained = add_digits_version(repository, 0.5)
    refused = add_digits_version(
        repository, 1.0, "tests.torch_models:DigitsThatCannotLoadInTheSecondEngine"
    )
    with serve_with_engines(
        tmp_path,
        WORKERS,
        BATCHSERVE_DEVICE="cpu,cpu",
        BATCHSERVE_MODEL_REPOSITORY=str(repository),
        BATCHSERVE_MODEL_VERSION=DIGITS.version,
        BATCHSERVE_ADMIN_TOKEN=TOKEN,
        PYTHONPATH=str(REPOSITORY_ROOT),  # the refused version's architecture is in tests/
    ) as server:
        wait_until_serving(server, WORKERS, engines=2)

        response = switch(server.url, f"/models/digits/versions/{refused}/load")
        assert response.status_code == 422, response.text
        assert "second device" in response.json()["error"]["message"]
        assert served_versions(server.url) == {f"digits@{DIGITS.version}"}
        engines = httpx.get(server.url + "/models", timeout=5.0).json()["engines"]
        assert [engine["version"] for engine in engines] == [DIGITS.version] * 2

        response = switch(server.url, f"/models/digits/versions/{retrained}/load")
        assert response.status_code == 200, response.text
        assert response.json()["replaced"] == f"digits@{DIGITS.version}"
        assert served_versions(server.url) == {f"digits@{retrained}"}
        info = {"model": "digits", "device": "cpu", "precision": "fp32", "compiled": "False"}
        model_info = "batchserve_model_info"
        assert scraped(server.url, model_info, info | {"version": retrained}) == 1
        assert scraped(server.url, model_info, info | {"version": DIGITS.version}) == 0

        # An engine started after the switch (the replacement of a killed one) serves the
        # switched-to version, not BATCHSERVE_MODEL_VERSION, and a rollback reaches both.
        os.kill(engine_pids(server)[0], signal.SIGKILL)
        wait_for(
            lambda: server.output().count('"event":"engine_process_started"') == 3,
            "the engine restarted",
            server,
        )
        wait_until_serving(server, WORKERS, engines=2)
        assert served_versions(server.url) == {f"digits@{retrained}"}
        response = switch(server.url, "/rollback")
        assert response.status_code == 200, response.text
        assert served_versions(server.url) == {f"digits@{DIGITS.version}"}


def test_rollback_gives_the_same_answer_whichever_front_end_takes_it(tmp_path: Path) -> None:
    """With a model copy per worker, rollback answered 409 from the workers that had not made
    the switch themselves; the engine keeps the one history."""
    repository = tmp_path / "models"
    copy_bundled_digits(repository)
    retrained = add_digits_version(repository, 0.5)
    with serve_with_engines(
        tmp_path,
        WORKERS,
        BATCHSERVE_MODEL_REPOSITORY=str(repository),
        BATCHSERVE_MODEL_VERSION=DIGITS.version,
        BATCHSERVE_ADMIN_TOKEN=TOKEN,
    ) as server:
        wait_until_serving(server, WORKERS)
        assert switch(server.url, f"/models/digits/versions/{retrained}/load").status_code == 200
        expected = [DIGITS.version, retrained] * 3
        for version in expected:  # each on a new connection: either front end may answer
            response = switch(server.url, "/rollback")
            assert response.status_code == 200, response.text
            assert response.json()["serving"]["version"] == version
