"""The load-test harness: its wrk scripts, workloads, HTTP ceiling, process memory, and the
sweep end to end at tiny scale."""

from __future__ import annotations

import collections
import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import torch
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from loadtests import memory, servers
from loadtests.configs import (
    CONFIGURATIONS,
    DIGITS,
    ENGINE_MODE_VARIABLE,
    MLP,
    MLP_MODEL,
    WORKERS_VARIABLE,
    Configuration,
    front_ends,
    unavailable_reason,
)
from loadtests.http_ceiling import create_ceiling_app
from loadtests.wrk import lua_long_string, parse_result, write_script
from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.engine.model_store import ModelStore
from service.server.cli import serves_in_one_process
from service.server.single import create_app

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


def test_a_baseline_lacking_a_setting_or_the_models_module_cannot_run_it(tmp_path: Path) -> None:
    old_fields = set(Settings.model_fields) - {"engine_mode"}
    process = CONFIGURATIONS["mlp-w1-process"]
    reason = unavailable_reason(
        process, tmp_path / "models", settings_fields=old_fields, checkout=tmp_path
    )
    assert reason is not None
    assert ENGINE_MODE_VARIABLE in reason
    assert str(tmp_path) in reason

    single = CONFIGURATIONS["mlp-single"]
    reason = unavailable_reason(
        single, tmp_path / "models", settings_fields=old_fields, checkout=tmp_path
    )
    assert reason is not None
    assert "service/models/mlp.py" in reason
    module = tmp_path / "service" / "models" / "mlp.py"
    module.parent.mkdir(parents=True)
    module.write_text("")
    assert (
        unavailable_reason(
            single, tmp_path / "models", settings_fields=old_fields, checkout=tmp_path
        )
        is None
    )


@pytest.mark.parametrize(
    ("workers", "engine_mode"),
    [(1, "auto"), (1, "in_process"), (1, "process"), (2, "auto"), (2, "process")],
)
def test_the_ceilings_front_ends_follow_the_servers_rule(workers: int, engine_mode: str) -> None:
    env = {WORKERS_VARIABLE: str(workers), ENGINE_MODE_VARIABLE: engine_mode}
    settings = Settings(device="cpu", workers=workers, engine_mode=engine_mode)
    one_process = serves_in_one_process(settings)
    assert (front_ends(env) == 0) == one_process
    assert front_ends(env) in (0, workers)


def test_the_baseline_is_started_with_its_own_layouts_cli(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        servers.checkout_command(tmp_path)
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "cli.py").write_text("")
    assert servers.checkout_command(tmp_path)[1:] == ["-m", "service.cli", "serve"]
    (tmp_path / "service" / "server").mkdir()
    (tmp_path / "service" / "server" / "cli.py").write_text("")
    assert servers.checkout_command(tmp_path)[1:] == ["-m", "service.server.cli", "serve"]


PYTHON = "/venv/bin/python"
GUNICORN = f"{PYTHON} -m gunicorn --config python:service.server.gunicorn_conf app()"


@pytest.mark.parametrize(
    ("parents", "commands", "expected"),
    [
        pytest.param(
            {10: 1}, {10: f"{PYTHON} -m service.cli serve"}, {10: "server"}, id="one process"
        ),
        pytest.param(
            {10: 1, 11: 10, 12: 10, 13: 12, 14: 12},
            {
                10: "/venv/bin/batchserve serve",
                11: f"{PYTHON} -m service.engine.process",
                12: GUNICORN,
                13: GUNICORN,
                14: GUNICORN,
            },
            {
                10: "supervisor",
                11: "engine",
                12: "gunicorn master",
                13: "gunicorn worker",
                14: "gunicorn worker",
            },
            id="supervisor, engine and front ends",
        ),
        pytest.param(
            {10: 1, 13: 10, 14: 10, 99: 1},
            {10: GUNICORN, 13: GUNICORN, 14: GUNICORN, 99: GUNICORN},
            {10: "gunicorn master", 13: "gunicorn worker", 14: "gunicorn worker"},
            id="older layout: serve replaced itself with gunicorn",
        ),
    ],
)
def test_process_roles_come_from_the_tree(
    parents: dict[int, int], commands: dict[int, str], expected: dict[int, str]
) -> None:
    assert memory.roles(10, parents, commands) == expected


def test_tree_memory_reads_each_process_of_the_tree() -> None:
    command = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"]
    with subprocess.Popen(command, stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"up\n"
            found = {process.pid: process for process in memory.tree_memory(os.getpid())}
        finally:
            child.kill()
    # Only an unrelated child: this process is the server itself, not a supervisor.
    assert found[os.getpid()].role == "server"
    assert found[child.pid].role == "other"
    assert found[os.getpid()].rss_bytes > found[child.pid].rss_bytes > 1_000_000
    assert "time.sleep(30)" in found[child.pid].command


async def post_json(app: FastAPI, bodies: list[bytes]) -> list[httpx.Response]:
    async with LifespanManager(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {"Content-Type": "application/json"}
            return [await client.post("/predict", content=b, headers=headers) for b in bodies]


async def test_the_http_ceiling_validates_like_the_server_and_answers_zeros() -> None:
    app = create_ceiling_app(Settings(device="cpu"), in_process=True)
    good, wrong_shape = await post_json(
        app, [DIGITS.bodies()[0], orjson.dumps({"instances": [[1.0] * 8]})]
    )
    assert good.status_code == 200
    answer = good.json()
    assert answer["model"] == "digits"
    assert answer["version"] == ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("digits").version
    assert answer["predictions"] == [[0.0] * 10]
    assert wrong_shape.status_code == 422
    assert "(N, 8, 8)" in wrong_shape.json()["error"]["message"]


def test_the_http_ceiling_never_imports_torch() -> None:
    """Its gunicorn front ends must cost what the server's own front ends cost."""
    check = "import sys, loadtests.http_ceiling; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], cwd=REPO_ROOT, timeout=60).returncode == 0


@pytest.fixture(scope="module")
def mlp_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return MLP_MODEL.package(tmp_path_factory.mktemp("mlp"))


def test_the_mlp_is_packaged_with_seeded_weights(mlp_repository: Path, tmp_path: Path) -> None:
    again = MLP_MODEL.package(tmp_path)
    assert [m.version for m in ModelStore(again).versions("mlp")] == [
        m.version for m in ModelStore(mlp_repository).versions("mlp")
    ]


async def test_the_mlp_workload_is_answered_by_the_packaged_peer_mlp(
    mlp_repository: Path,
) -> None:
    bodies = MLP.bodies()[:3]
    app = create_app(Settings(device="cpu", model_repository=mlp_repository, model_name="mlp"))
    responses = await post_json(app, bodies)
    module = ModelStore(mlp_repository).load("mlp").module
    for body, response in zip(bodies, responses, strict=True):
        assert response.status_code == 200, response.text
        features = np.asarray(orjson.loads(body)["instances"], dtype=np.float32)
        assert features.shape == (1, 256)
        with torch.inference_mode():
            expected = module(torch.from_numpy(features)).numpy()
        np.testing.assert_allclose(response.json()["predictions"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sweep_writes_results_report_and_plots(tmp_path: Path) -> None:
    """Two front ends and an engine, against the same code run as the baseline checkout."""
    require_wrk()
    out = tmp_path / "bench"
    completed = subprocess.run(
        [
            sys.executable, "-m", "loadtests.sweep",
            "--configs", "mlp-w2",
            "--concurrency", "1", "4",
            "--duration-s", "1",
            "--repeats", "1",
            "--warmup-s", "0",
            "--model-limit-s", "0.1",
            "--generator-duration-s", "1",
            "--baseline-checkout", str(REPO_ROOT),
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
        ("mlp-w2", 1),
        ("mlp-w2", 4),
        ("mlp-w2@baseline", 1),
        ("mlp-w2@baseline", 4),
    ]
    for row in rows:
        assert float(row["requests_per_s"]) > 0
        assert int(row["errors"]) == 0
        assert 0 < float(row["p50_ms"]) <= float(row["p95_ms"]) <= float(row["p99_ms"])
        assert float(row["mean_rows_per_batch"]) >= 1.0
        assert row["http_ceiling"] == "http-ceiling-w2"
        assert float(row["http_ceiling_requests_per_s"]) > 0
        assert float(row["model_limit_rows_per_s"]) > 0
        assert float(row["fraction_of_bound"]) > 0

    limits = read_csv(out / "model_limits.csv")
    assert [int(row["batch_size"]) for row in limits] == [1, 2, 4, 8, 16, 32, 64]
    assert all(float(row["rows_per_s"]) > 0 for row in limits)
    ceilings = read_csv(out / "http_ceiling.csv")
    assert {row["server"] for row in ceilings} == {"http-ceiling-w2", "load-generator"}
    assert all(float(row["requests_per_s"]) > 0 for row in ceilings)

    processes = read_csv(out / "memory.csv")
    for label in ("mlp-w2", "mlp-w2@baseline"):
        rss_mib = collections.defaultdict(list)
        for row in processes:
            if row["configuration"] == label:
                rss_mib[row["role"]].append(float(row["rss_mib"]))
        assert {role: len(values) for role, values in rss_mib.items()} == {
            "supervisor": 1,
            "engine": 1,
            "gunicorn master": 1,
            "gunicorn worker": 2,
        }
        # The model lives in the engine; the front ends never import torch.
        assert min(rss_mib["engine"]) > max(rss_mib["gunicorn worker"]) + 100

    report = (out / "report.md").read_text()
    assert "| mlp-w2 | 4 |" in report
    assert "| mlp-w2@baseline | 4 |" in report
    assert "## This checkout against the baseline checkout" in report
    assert "## Resident memory per process" in report
    assert "## Load generator ceiling" in report
    assert f"baseline: {REPO_ROOT} at " in report
    for name in ("throughput.png", "latency.png"):
        image = (out / name).read_bytes()
        assert image.startswith(PNG_SIGNATURE)
        assert len(image) > 10_000
