"""The load-test harness: its wrk scripts, and the sweep end to end at tiny scale."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.configs import DIGITS, Configuration, unavailable_reason
from loadtests.wrk import lua_long_string, parse_result, write_script
from service.config import BUNDLED_MODEL_REPOSITORY

REPO_ROOT = Path(__file__).resolve().parent.parent
SWEEP_TIMEOUT_S = 180
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def require_wrk() -> None:
    """Skip without wrk, except in CI, where .ci/run installs it and its absence is a failure."""
    if shutil.which("wrk") is not None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail("wrk is not installed although CI=true: .ci/run should install it")
    pytest.skip("wrk is not installed (apt-get install wrk); CI installs it")


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def testlua_long_strings_pick_a_closing_bracket_absent_from_the_body() -> None:
    assert lua_long_string(b'{"instances":[[[1]]]}') == '[==[{"instances":[[[1]]]}]==]'
    assert lua_long_string(b"a]==]b") == "[===[a]==]b]===]"


def test_bodies_that_a_long_string_would_alter_go_to_files(tmp_path: Path) -> None:
    npy_like = b"\x93NUMPY\r\n\x00"
    script = write_script(tmp_path, [b'{"a":[[1]]}', npy_like], {"Content-Type": "x"})
    text = script.read_text()
    assert '[==[{"a":[[1]]}]==]' in text
    assert "read_file(" in text
    assert (tmp_path / "body-0001.bin").read_bytes() == npy_like


def test_parse_result_counts_socket_and_status_errors() -> None:
    output = (
        "Running 2s test\nLOADTESTS_RESULT "
        '{"requests":500,"duration_us":2000000,"bytes":1,"connect":1,"read":2,"write":0,'
        '"status":3,"timeout":4,"p50_us":1500,"p95_us":2500,"p99_us":4000,'
        '"mean_us":1.0,"max_us":9}\n'
    )
    result = parse_result(output)
    assert result.requests_per_s == 250
    assert (result.socket_errors, result.status_errors, result.errors) == (7, 3, 10)
    assert (result.p50_ms, result.p95_ms, result.p99_ms) == (1.5, 2.5, 4.0)


def test_a_setting_the_service_lacks_makes_a_configuration_unavailable() -> None:
    configuration = Configuration("x", DIGITS, "x", {"BATCHSERVE_NO_SUCH_SETTING": "1"})
    reason = unavailable_reason(configuration, BUNDLED_MODEL_REPOSITORY)
    assert reason is not None
    assert "BATCHSERVE_NO_SUCH_SETTING" in reason
    assert unavailable_reason(Configuration("y", DIGITS, "y"), BUNDLED_MODEL_REPOSITORY) is None


@pytest.mark.slow
def test_sweep_writes_results_report_and_plots(tmp_path: Path) -> None:
    require_wrk()
    out = tmp_path / "bench"
    completed = subprocess.run(
        [
            sys.executable, "-m", "loadtests.sweep",
            "--configs", "digits-batched",
            "--concurrency", "1", "4",
            "--duration-s", "2",
            "--repeats", "1",
            "--warmup-s", "0",
            "--model-limit-s", "0.1",
            "--generator-duration-s", "1",
            "--out", str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=SWEEP_TIMEOUT_S,
        check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]

    rows = read_csv(out / "results.csv")
    assert [(row["configuration"], int(row["concurrency"])) for row in rows] == [
        ("digits-batched", 1),
        ("digits-batched", 4),
    ]
    for row in rows:
        assert float(row["requests_per_s"]) > 0
        assert int(row["errors"]) == 0
        assert 0 < float(row["p50_ms"]) <= float(row["p95_ms"]) <= float(row["p99_ms"])
        assert float(row["mean_rows_per_batch"]) >= 1.0
        assert float(row["http_ceiling_requests_per_s"]) > 0
        assert float(row["model_limit_rows_per_s"]) > 0
        assert float(row["fraction_of_bound"]) > 0

    limits = read_csv(out / "model_limits.csv")
    assert [int(row["batch_size"]) for row in limits] == [1, 2, 4, 8, 16, 32, 64]
    assert all(float(row["rows_per_s"]) > 0 for row in limits)
    servers = {row["server"] for row in read_csv(out / "http_ceiling.csv")}
    assert servers == {"http-ceiling", "load-generator"}

    report = (out / "report.md").read_text()
    assert "| digits-batched | 4 |" in report
    assert "## Load generator ceiling" in report
    assert "req/s" in report
    for name in ("throughput.png", "latency.png"):
        image = (out / name).read_bytes()
        assert image.startswith(PNG_SIGNATURE)
        assert len(image) > 10_000
