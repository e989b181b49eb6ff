"""``batchserve rollout`` against a real server (engine process, one front end): a candidate
that disagrees on 5 % of inputs is rolled back at its first step naming the check; a plan
interrupted by kill -9 of the engine and of the command is resumed by a rerun and finishes,
never half applied."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.server.cli import build_parser
from service.server.rollout_command import EXIT_PROMOTED, EXIT_ROLLED_BACK, run_rollout
from tests.processes import (
    BATCHSERVE,
    Running,
    engine_pids,
    serve_with_engines,
    wait_for,
    wait_until_serving,
)
from tests.torch_models import package_threshold_classifier

TOKEN = "rollout-admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """``threshold`` at three versions: ``v1`` (never high), ``worse`` (high from 95: it
    disagrees with v1 on 5 of every 100 values 0-99) and ``same`` (never high either: it
    agrees with v1 on every value)."""
    root = tmp_path_factory.mktemp("rollout") / "models"
    packaged = {
        "v1": package_threshold_classifier(root, 1000.0),
        "worse": package_threshold_classifier(root, 95.0),
        "same": package_threshold_classifier(root, 2000.0),
    }
    return root, packaged


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, versions: tuple[Path, dict[str, str]]
) -> Iterator[Running]:
    """One server for the module's tests (each starts where the one before left: v1)."""
    root, packaged = versions
    with serve_with_engines(
        tmp_path_factory.mktemp("server"),
        1,
        BATCHSERVE_MODEL_REPOSITORY=str(root),
        BATCHSERVE_MODEL_NAME="threshold",
        BATCHSERVE_MODEL_VERSION=packaged["v1"],
        BATCHSERVE_ADMIN_TOKEN=TOKEN,
        BATCHSERVE_SPARE_ENGINE="false",
    ) as running:
        wait_until_serving(running, 1)
        yield running


@contextmanager
def traffic(url: str) -> Iterator[list[str]]:
    """Requests of the values 0-99 in turn, one at a time, until the block ends; the version
    of each answer (every answer must be a 200, or a 503 while the engine restarts)."""
    versions: list[str] = []
    stop = threading.Event()

    def send() -> None:
        with httpx.Client(base_url=url, timeout=10.0) as client:
            value = 0
            while not stop.is_set():
                try:
                    answer = client.post("/predict", json={"instances": [[float(value)]]})
                except httpx.TransportError:
                    continue
                assert answer.status_code in (200, 503), answer.text
                if answer.status_code == 200:
                    versions.append(answer.json()["version"])
                value = (value + 1) % 100

    sender = threading.Thread(target=send)
    sender.start()
    try:
        yield versions
    finally:
        stop.set()
        sender.join(timeout=30)


def command(url: str, to: str, *extra: str) -> list[str]:
    return [
        "rollout", "--url", url, "--token", TOKEN, "--model", "threshold", "--to", to,
        "--steps", "10,50,100", "--hold-s", "0", "--min-requests", "100", "--min-agreement",
        "0.99", "--max-p99-ratio", "100", "--poll-s", "0.2", "--step-timeout-s", "20", *extra,
    ]  # fmt: skip


def rollout(url: str, to: str, *extra: str) -> tuple[int, list[str]]:
    lines: list[str] = []
    status = run_rollout(build_parser().parse_args(command(url, to, *extra)), lines.append)
    return status, lines


def plan_of(url: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/admin/models/threshold/rollout", headers=AUTH, timeout=5.0)
    assert answer.status_code == 200, answer.text
    plan: dict[str, Any] = answer.json()
    return plan


def serving(url: str) -> str:
    listed = httpx.get(f"{url}/admin/models/threshold/versions", headers=AUTH, timeout=5.0)
    return str(listed.json()["serving"])


def test_a_candidate_disagreeing_on_5_percent_is_rolled_back_at_its_first_step(
    server: Running, versions: tuple[Path, dict[str, str]]
) -> None:
    _, packaged = versions
    with traffic(server.url) as answered:
        status, lines = rollout(server.url, packaged["worse"])
        assert status == EXIT_ROLLED_BACK, lines
        assert "failed check: agreement" in lines[-1], lines
        plan = plan_of(server.url)
        assert plan["state"] == "rolled_back"
        (decision,) = plan["decisions"]
        assert (decision["percent"], decision["verdict"], decision["check"]) == (
            10,
            "rollback",
            "agreement",
        )
        assert serving(server.url) == packaged["v1"]
        gone = httpx.get(f"{server.url}/admin/models/threshold/shadow", headers=AUTH)
        assert gone.status_code == 404  # the shadow was stopped and its candidate unloaded
    # Clients were answered by the old version, and by the candidate only while it had its
    # 10 %; once rolled back, by the old version alone.
    assert set(answered) <= {packaged["v1"], packaged["worse"]}
    assert (
        httpx.post(f"{server.url}/predict", json={"instances": [[99.0]]}).json()["version"]
        == (packaged["v1"])
    )


def test_a_plan_interrupted_by_kill_9_of_the_engine_and_the_command_resumes_and_finishes(
    server: Running, versions: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The engine and ``batchserve rollout`` itself are killed (SIGKILL) mid-step: the plan
    stays recorded at its step, the restarted engine serves what the step had applied, and
    the command run again resumes the plan and promotes."""
    _, packaged = versions
    with traffic(server.url) as answered:
        (engine,) = engine_pids(server)
        log = tmp_path / "rollout.log"
        with log.open("wb") as output:
            first = subprocess.Popen(
                [
                    str(BATCHSERVE),
                    *command(server.url, packaged["same"], "--steps", "50,100"),
                    *("--min-requests", "100000"),
                ],
                stdout=output,
                stderr=subprocess.STDOUT,
            )  # it holds its first step: its window never fills
        try:
            wait_for(
                lambda: (
                    httpx.get(
                        f"{server.url}/admin/models/threshold/shadow", headers=AUTH
                    ).status_code
                    == 200
                ),
                "the first step shadowing the candidate",
                server,
            )
        finally:
            os.kill(engine, signal.SIGKILL)
            first.kill()
            first.wait(timeout=30)
        plan = plan_of(server.url)
        assert (plan["state"], plan["step"], plan["to_version"]) == ("running", 0, packaged["same"])
        # The engine, restarted, serves what it served: v1, beside the candidate's 50 %.
        wait_for(lambda: serving(server.url) == packaged["v1"], "the engine back", server)
        wait_until_serving(server, 1)
        status, lines = rollout(server.url, packaged["same"])
        assert status == EXIT_PROMOTED, (lines, log.read_text())
        assert lines[0].startswith("resuming the rollout of threshold")
        assert serving(server.url) == packaged["same"]
        assert plan_of(server.url)["state"] == "promoted"
    assert set(answered) <= {packaged["v1"], packaged["same"]}
