"""How ``batchserve serve`` lays out its processes, without starting them (test_server.py
does): the metrics folder, the settings every process reads, gunicorn's options, and which
devices get an engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.config import Settings
from service.metrics import MULTIPROCESS_DIR_ENV
from service.server import devices
from service.server.cli import serves_in_one_process
from service.server.devices import engine_devices
from service.server.gunicorn_setup import graceful_timeout_s
from service.server.launcher import prepare_multiprocess_dir, settings_environment


def test_a_named_metrics_dir_loses_its_stale_metric_files_only(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    directory.mkdir()
    (directory / "counter_123.db").write_bytes(b"old counts")
    (directory / "gauge_livesum_123.db").write_bytes(b"old gauge")
    (directory / "notes.txt").write_text("not a metric file")
    environ = {MULTIPROCESS_DIR_ENV: str(directory)}

    assert prepare_multiprocess_dir(environ) == (directory, False)
    assert sorted(path.name for path in directory.iterdir()) == ["notes.txt"]
    assert environ == {MULTIPROCESS_DIR_ENV: str(directory)}


def test_a_named_metrics_dir_that_does_not_exist_is_created(tmp_path: Path) -> None:
    directory = tmp_path / "emptydir" / "metrics"
    prepare_multiprocess_dir({MULTIPROCESS_DIR_ENV: str(directory)})
    assert directory.is_dir()


def test_without_a_named_dir_a_temporary_one_is_made_and_named() -> None:
    environ: dict[str, str] = {}
    directory, temporary = prepare_multiprocess_dir(environ)
    try:
        assert temporary
        assert directory.is_dir()
        assert list(directory.iterdir()) == []
        assert environ[MULTIPROCESS_DIR_ENV] == str(directory)
    finally:
        directory.rmdir()


def test_flags_reach_every_process_as_environment_variables() -> None:
    assert settings_environment({"max_batch_size": "32", "workers": "4"}) == {
        "BATCHSERVE_MAX_BATCH_SIZE": "32",
        "BATCHSERVE_WORKERS": "4",
    }


def test_a_list_reaches_a_process_as_the_settings_read_it() -> None:
    for models in [(), ("digits",), ("digits", "textenc@ba5b32c1c5e8")]:
        variables = settings_environment({"models": models})
        assert Settings(_env_file=None, **{"models": variables["BATCHSERVE_MODELS"]}).models == (
            models
        )


def test_gunicorn_waits_for_the_drain_and_the_longest_request() -> None:
    settings = Settings(request_timeout_ms=10_000, drain_delay_s=2.5)
    assert (
        graceful_timeout_s(settings) > settings.drain_delay_s + settings.request_timeout_ms / 1000
    )


def gunicorn_configuration(
    env: dict[str, str], expression: str
) -> subprocess.CompletedProcess[str]:
    """Import gunicorn's configuration module the way gunicorn does, in a clean interpreter."""
    return subprocess.run(
        [sys.executable, "-c", f"import service.server.gunicorn_conf as c; print({expression})"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_gunicorn_gives_each_front_end_its_own_socket(tmp_path: Path) -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if key != MULTIPROCESS_DIR_ENV and not key.startswith("BATCHSERVE_")
    }
    refused = gunicorn_configuration(env, "c.workers")
    assert refused.returncode != 0
    assert "PROMETHEUS_MULTIPROC_DIR must name an existing, empty folder" in refused.stderr

    env |= {MULTIPROCESS_DIR_ENV: str(tmp_path), "BATCHSERVE_WORKERS": "3"}
    loaded = gunicorn_configuration(env, "c.workers, c.bind, c.reuse_port, c.max_requests")
    # reuse_port: the kernel spreads connections over the front ends' sockets evenly.
    assert loaded.stdout.strip() == "3 ['127.0.0.1:8000'] True 0", loaded.stderr


def no_gpu() -> int:
    return 0


def two_gpus() -> int:
    return 2


@pytest.mark.parametrize(
    ("device", "count", "expected"),
    [
        ("auto", no_gpu, ["cpu"]),
        ("auto", two_gpus, ["cuda:0", "cuda:1"]),
        ("cuda", two_gpus, ["cuda:0", "cuda:1"]),
        ("cpu", two_gpus, ["cpu"]),
        ("cuda:1", two_gpus, ["cuda:1"]),
        ("cuda:0,cuda:2", no_gpu, ["cuda:0", "cuda:2"]),
        ("cpu,cpu", no_gpu, ["cpu", "cpu"]),
    ],
)
def test_one_engine_per_device(device: str, count: object, expected: list[str]) -> None:
    assert engine_devices(device, count) == expected  # type: ignore[arg-type]


def test_cuda_without_a_gpu_is_an_error_not_the_cpu() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        engine_devices("cuda", no_gpu)


def test_gpus_are_counted_without_torch_when_no_nvidia_driver_is_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(devices, "NVIDIA_DRIVER", tmp_path / "absent")
    assert devices.count_cuda_devices() == 0


@pytest.mark.parametrize(
    ("settings", "alone"),
    [
        (Settings(device="cpu"), True),
        (Settings(device="cpu", workers=2), False),
        (Settings(device="cpu", engine_mode="process"), False),
        (Settings(device="cpu,cpu"), False),
    ],
)
def test_one_worker_on_one_device_serves_in_one_process(settings: Settings, alone: bool) -> None:
    assert serves_in_one_process(settings) is alone


def test_in_process_with_several_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="engine_mode in_process serves with one worker"):
        Settings(workers=2, engine_mode="in_process")
