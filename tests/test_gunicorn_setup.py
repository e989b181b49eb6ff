"""The launcher and the gunicorn options, without starting gunicorn (test_gunicorn.py does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.config import Settings
from service.gunicorn_setup import (
    TEMPORARY_METRICS_DIR_ENV,
    bind_address,
    create_version_dir,
    give_worker_a_slot,
    graceful_timeout_s,
    gunicorn_options,
    remove_run_folders,
)
from service.launcher import prepare_multiprocess_dir, settings_environment
from service.metrics import MULTIPROCESS_DIR_ENV
from service.version_sync import VERSION_DIR_ENV, PublishedVersion, publish, read_published


def test_a_named_metrics_dir_loses_its_stale_metric_files_only(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    directory.mkdir()
    (directory / "counter_123.db").write_bytes(b"old counts")
    (directory / "gauge_livesum_123.db").write_bytes(b"old gauge")
    (directory / "notes.txt").write_text("not a metric file")
    environ = {MULTIPROCESS_DIR_ENV: str(directory)}

    assert prepare_multiprocess_dir(environ) == directory
    assert sorted(path.name for path in directory.iterdir()) == ["notes.txt"]
    assert environ == {MULTIPROCESS_DIR_ENV: str(directory)}


def test_a_named_metrics_dir_that_does_not_exist_is_created(tmp_path: Path) -> None:
    directory = tmp_path / "emptydir" / "metrics"
    prepare_multiprocess_dir({MULTIPROCESS_DIR_ENV: str(directory)})
    assert directory.is_dir()


def test_without_a_named_dir_a_temporary_one_is_made_and_removed_on_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    environ: dict[str, str] = {}
    directory = prepare_multiprocess_dir(environ)
    assert directory.is_dir()
    assert list(directory.iterdir()) == []
    assert environ[MULTIPROCESS_DIR_ENV] == environ[TEMPORARY_METRICS_DIR_ENV] == str(directory)

    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    remove_run_folders(server=None)
    assert not directory.exists()


def test_a_dir_named_by_the_operator_is_kept_on_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MULTIPROCESS_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(TEMPORARY_METRICS_DIR_ENV, raising=False)
    remove_run_folders(server=None)
    assert tmp_path.is_dir()


def test_the_published_version_folder_lives_as_long_as_the_master(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(VERSION_DIR_ENV, raising=False)
    create_version_dir(server=None)
    folder = Path(os.environ[VERSION_DIR_ENV])
    assert folder.is_dir()
    publish(PublishedVersion("digits", "abc123", previous=("digits", "0ld")))
    assert read_published() == PublishedVersion("digits", "abc123", ("digits", "0ld"))
    remove_run_folders(server=None)
    assert not folder.exists()
    assert VERSION_DIR_ENV not in os.environ
    assert read_published() is None


def test_flags_reach_the_workers_as_environment_variables() -> None:
    assert settings_environment({"max_batch_size": "32", "workers": "4"}) == {
        "BATCHSERVE_MAX_BATCH_SIZE": "32",
        "BATCHSERVE_WORKERS": "4",
    }


def test_gunicorn_waits_long_enough_to_drain() -> None:
    settings = Settings(request_timeout_ms=10_000, drain_delay_s=2.5)
    # 3 s drain delay (rounded up) + 10 s deadline + 5 s for the worker + 5 s to exit.
    assert graceful_timeout_s(settings) == 23
    options = gunicorn_options(Settings(workers=3, host="0.0.0.0", port=9000))
    assert options["bind"] == ["0.0.0.0:9000"]
    assert options["workers"] == 3
    assert options["max_requests"] == 0
    assert options["worker_class"] == "service.gunicorn_worker.BatchserveWorker"
    assert bind_address("::", 8000) == "[::]:8000"


class _Worker:
    """What gunicorn's master hands to ``pre_fork``: a worker object with attributes."""


class _Master:
    def __init__(self, workers: dict[int, _Worker]) -> None:
        self.WORKERS = workers


def test_each_new_worker_gets_the_lowest_free_slot() -> None:
    live: dict[int, _Worker] = {}
    for pid in (100, 101, 102):
        worker = _Worker()
        give_worker_a_slot(_Master(live), worker)
        live[pid] = worker
    assert [vars(worker)["batchserve_slot"] for worker in live.values()] == [0, 1, 2]
    del live[101]
    replacement = _Worker()
    give_worker_a_slot(_Master(live), replacement)
    assert vars(replacement)["batchserve_slot"] == 1


def test_gunicorn_refuses_several_workers_without_a_metrics_dir(tmp_path: Path) -> None:
    """Run gunicorn's config module the way gunicorn does, in a clean interpreter."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key != MULTIPROCESS_DIR_ENV and not key.startswith("BATCHSERVE_")
    }
    result = subprocess.run(
        [sys.executable, "-c", "import service.gunicorn_conf"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "PROMETHEUS_MULTIPROC_DIR must name an existing, empty folder" in result.stderr

    env[MULTIPROCESS_DIR_ENV] = str(tmp_path)
    env["BATCHSERVE_WORKERS"] = "3"
    result = subprocess.run(
        [sys.executable, "-c", "import service.gunicorn_conf as c; print(c.workers, c.bind)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.stdout.split() == ["3", "['127.0.0.1:8000']"], result.stderr
