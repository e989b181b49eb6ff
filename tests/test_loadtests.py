"""The load-test harness: its wrk scripts, workloads, HTTP ceiling, process memory, the
servers kept running for interleaved rounds, and the sweep end to end at tiny scale."""

from __future__ import annotations

import collections
import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import torch
from fastapi import FastAPI

from loadtests import (
    embeddings,
    generation,
    handlers,
    models,
    protocols,
    restart_timeline,
    servers,
    sweep,
)
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
from loadtests.report import Point, SweepResult, markdown, summary_rows
from loadtests.wrk import WrkResult, lua_long_string, parse_result, write_script
from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.engine.model_store import ModelStore
from service.server.cli import serves_in_one_process
from service.server.single import create_app
from service.server.tuning.ceiling import create_ceiling_app
from tests.fixtures import lifespan

REPO_ROOT = Path(__file__).resolve().parent.parent
#: A hang guard, not a speed check: a sweep took 190 s beside other engineers' load.
SWEEP_TIMEOUT_S = 300
#: Each wrk run stops after this many requests (or its 1 s cap).
SWEEP_MAX_REQUESTS = 50
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
    assert servers.roles(10, parents, commands) == expected


def test_tree_memory_reads_each_process_of_the_tree() -> None:
    command = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"]
    with subprocess.Popen(command, stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"up\n"
            found = {process.pid: process for process in servers.tree_memory(os.getpid())}
        finally:
            child.kill()
    # Only an unrelated child: this process is the server itself, not a supervisor.
    assert found[os.getpid()].role == "server"
    assert found[child.pid].role == "other"
    assert found[os.getpid()].rss_bytes > found[child.pid].rss_bytes > 1_000_000
    assert "time.sleep(30)" in found[child.pid].command


def wrk_run(requests_per_s: float, p50_ms: float) -> WrkResult:
    return WrkResult(int(requests_per_s), 1.0, 0, 0, p50_ms, p50_ms * 2, p50_ms * 3)


def interleaved_result(rates: dict[str, list[float]], p50s: dict[str, list[float]]) -> SweepResult:
    """A result of interleaved rounds at c=1: run i of each label is round i + 1."""
    points = [
        Point(
            label, "mlp", 1, [wrk_run(r, p) for r, p in zip(rates[label], p50s[label], strict=True)]
        )
        for label in rates
    ]
    return SweepResult(
        points=points,
        ceilings=[],
        generator=None,
        model_limits={},
        unavailable={},
        notes=[],
        environment={},
        rounds=3,
        comparisons=[("mlp-w2", "mlp-single"), ("digits-w2", "digits-batched")],
    )


def test_the_report_gives_the_median_of_per_round_ratios_not_the_ratio_of_medians() -> None:
    # The machine slows by half in round 2 and speeds up in round 3; mlp-w2 is 10 % faster
    # than mlp-single in every round, which the ratio of the two medians (1.375) hides.
    result = interleaved_result(
        {"mlp-w2": [1100, 550, 2200], "mlp-single": [1000, 500, 2000]},
        {"mlp-w2": [1.0, 2.0, 0.5], "mlp-single": [1.2, 2.5, 0.4]},
    )
    result.points[1].runs[1] = wrk_run(400, 2.5)  # mlp-single's round 2 is the slowest of all
    report = markdown(result, summary_rows(result))
    assert "## Interleaved comparisons: ratio per round" in report
    assert "| mlp-w2 | mlp-single | 1 | 1.100 | 1.375 | 1.100 | **1.100** | 1.100 |" in report
    # p50 differences per round: -0.2, -0.5, +0.1; their median is -0.2.
    assert "| mlp-w2 | mlp-single | -0.200 | -0.500 | +0.100 | **-0.200** |" in report
    assert "digits-w2" not in report  # a pair not measured is left out
    assert "Served rows interleaved" in report


def test_the_report_gives_cpu_per_request_and_its_ratio_per_round() -> None:
    """CPU per answered request of each run, and a / b per round: 1,000 requests a round."""
    result = interleaved_result(
        {"mlp-w2": [1000, 1000, 1000], "mlp-single": [1000, 1000, 1000]},
        {"mlp-w2": [1.0, 1.0, 1.0], "mlp-single": [1.0, 1.0, 1.0]},
    )
    result.points[0].cpu_s = [0.30, 0.60, 0.33]  # 300, 600 and 330 µs a request
    result.points[1].cpu_s = [0.25, 0.40, 0.30]  # 250, 400 and 300
    rows = summary_rows(result)
    assert [row["cpu_us_per_request"] for row in rows] == [330.0, 300.0]
    report = markdown(result, rows)
    assert "### CPU per request, a / b per round" in report
    # Per round 1.2, 1.5 and 1.1: their median is 1.2, where the medians' ratio says 1.1.
    assert "| mlp-w2 | mlp-single | 1 | 1.200 | 1.500 | 1.100 | **1.200** | 330 | 300 |" in report


def test_the_plan_counts_every_server_of_the_interleaved_rounds() -> None:
    args = sweep.parse_args(
        ["--interleave", "--concurrency", "1", "4", "--repeats", "3", "--duration-s", "2"]
    )
    selected = [CONFIGURATIONS["mlp-single"], CONFIGURATIONS["mlp-w2"]]
    text = sweep.plan(args, selected)
    assert "2 server(s) started first" in text
    assert "3 round(s) x 2 concurrencies x 2 server(s) = 12 wrk runs" in text
    with pytest.raises(SystemExit):
        sweep.parse_args(["--interleave", "--url", "http://127.0.0.1:8000"])


def fill_pool_then_interrupt(
    pool: servers.ServerPool,
    tmp_path: Path,
    started: list[servers.RunningServer],
    left_behind: list[int],
) -> None:
    """Two servers up and one failed start, then Ctrl-C."""
    fixed = servers.module_command("loadtests.wrk")
    env = servers.server_env({})
    started.append(pool.start(fixed, env, tmp_path / "a.log", 30))
    with pytest.raises(servers.ServerError, match="exited with status 3"):
        pool.start([sys.executable, "-c", "exit(3)"], env, tmp_path / "b.log", 30)
    # A server that leaves a child behind when it is stopped.
    leaves_a_child = ["sh", "-c", f"sleep 60 & exec {' '.join(fixed)}"]
    started.append(pool.start(leaves_a_child, env, tmp_path / "c.log", 30))
    assert pool.started == started
    for server in started:
        assert httpx.get(server.url + "/readyz", timeout=5).status_code == 200
    left_behind += [p.pid for p in servers.tree_memory(started[1].pid) if p.command == "sleep 60"]
    assert len(left_behind) == 1
    raise KeyboardInterrupt


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_a_server_pool_goes_on_after_a_failed_start_and_stops_everything_on_ctrl_c(
    tmp_path: Path,
) -> None:
    """Each server in its own process group: what one leaves behind is stopped too."""
    started: list[servers.RunningServer] = []
    left_behind: list[int] = []
    with pytest.raises(KeyboardInterrupt), servers.ServerPool() as pool:
        fill_pool_then_interrupt(pool, tmp_path, started, left_behind)
    assert [server.exit_status() for server in started] == [-signal.SIGTERM] * 2
    assert not pool.started
    deadline = time.monotonic() + 10
    while running(left_behind[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(left_behind[0])


async def post_json(app: FastAPI, bodies: list[bytes]) -> list[httpx.Response]:
    async with lifespan(app):
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


async def test_what_the_benchmarks_send_is_answered_by_the_server() -> None:
    """The protocols, handlers and several-models benchmarks' requests, each answered 200 by
    the server in process: an API change fails here rather than in a benchmark run later."""
    served = ("digits", "textenc", "sentiment", "sentiment_tensors", "digits_png")
    app = create_app(Settings(device="cpu", models=served, warmup_batch_sizes=(1,)))
    json_type = {"Content-Type": "application/json"}
    sent = [(f"/models/{name}/predict", body, json_type) for name, body in models.bodies().items()]
    sent += list(protocols.http_workloads().values())
    sent += [
        (f"/models/{w.model}/predict", w.bodies[0], {"Content-Type": w.content_type})
        for w in handlers.workloads(image_size=32)
    ]
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for path, body, headers in sent:
                response = await client.post(path, content=body, headers=headers)
                assert response.status_code == 200, (path, response.text)
    assert len(sent) == 2 + 4 + 4


def test_the_handler_costs_are_measured_for_each_demo_handler() -> None:
    table = handlers.handler_costs(calls=3, image_size=32)
    rows = [line for line in table if line.startswith("| text") or line.startswith("| image")]
    assert len(rows) == 4
    for row in rows:
        pre_us, post_us = (float(cell) for cell in row.strip("| ").split(" | ")[-2:])
        assert pre_us > 0
        assert post_us > 0


def test_the_http_ceiling_never_imports_torch() -> None:
    """Its gunicorn front ends must cost what the server's own front ends cost."""
    check = "import sys, service.server.tuning.ceiling; sys.exit('torch' in sys.modules)"
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


def run_sweep(out: Path, *options: str) -> None:
    """A tiny sweep against the same code run as the baseline checkout."""
    require_wrk()
    completed = subprocess.run(
        [
            sys.executable, "-m", "loadtests.sweep",
            *options,
            "--duration-s", "1",
            # Runs of a few hundred ms: the harness's bookkeeping is the point, not its figures.
            "--max-requests", str(SWEEP_MAX_REQUESTS),
            "--warmup-s", "0",
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


@pytest.mark.slow
def test_sweep_writes_results_report_and_plots(tmp_path: Path) -> None:
    """Two front ends and an engine, against the same code run as the baseline checkout."""
    out = tmp_path / "bench"
    run_sweep(
        out,
        "--configs", "mlp-w2",
        "--concurrency", "1", "4",
        "--repeats", "1",
        "--model-limit-s", "0.1",
        "--generator-duration-s", "1",
    )  # fmt: skip

    rows = read_csv(out / "results.csv")
    assert [(row["configuration"], int(row["concurrency"])) for row in rows] == [
        ("mlp-w2", 1),
        ("mlp-w2", 4),
        ("mlp-w2@baseline", 1),
        ("mlp-w2@baseline", 4),
    ]
    assert sum(float(row["cpu_us_per_request"]) for row in rows) > 0
    for row in rows:
        assert float(row["requests_per_s"]) > 0
        assert int(row["errors"]) == 0
        assert 0 < float(row["p50_ms"]) <= float(row["p95_ms"]) <= float(row["p99_ms"])
        assert float(row["mean_rows_per_batch"]) >= 1.0
        assert float(row["cpu_us_per_request"]) >= 0  # 10 ms ticks: a short run may read 0
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
            "spare engine": 1,  # started once the engine is ready (spare_engine)
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


@pytest.mark.slow
def test_an_interleaved_sweep_reports_the_ratio_per_round(tmp_path: Path) -> None:
    """Both servers up at once, taking turns: a run of each per concurrency and round."""
    out = tmp_path / "bench"
    run_sweep(
        out,
        "--configs", "mlp-single",
        "--interleave",
        "--concurrency", "1", "4",
        "--repeats", "2",
        "--no-model-limit",
        "--no-http-ceiling",
        "--no-generator-ceiling",
    )  # fmt: skip
    runs = read_csv(out / "runs.csv")
    assert [(row["configuration"], row["concurrency"], row["run"]) for row in runs] == [
        (label, concurrency, run)
        for label in ("mlp-single", "mlp-single@baseline")
        for concurrency in ("1", "4")
        for run in ("1", "2")
    ]
    assert all(float(row["requests_per_s"]) > 0 and row["errors"] == "0" for row in runs)
    rows = read_csv(out / "results.csv")
    assert [row["runs"] for row in rows] == ["2"] * 4
    assert all(float(row["mean_rows_per_batch"]) >= 1.0 for row in rows)
    assert {row["configuration"] for row in read_csv(out / "memory.csv")} == {
        "mlp-single",
        "mlp-single@baseline",
    }

    report = (out / "report.md").read_text()
    assert "served rows interleaved: 2 server(s) started first" in report
    assert "for 2 round(s)" in report
    assert "## Interleaved comparisons: ratio per round" in report
    table = [line for line in report.splitlines() if line.startswith("| mlp-single | mlp-single@")]
    per_round, p50, cpu = table[:2], table[2:3], table[3:]
    assert [line.split(" | ")[2] for line in per_round] == ["1", "4"]
    for line in per_round:
        *rounds, median, _ = line.strip("| ").split(" | ")[3:]
        assert len(rounds) == 2
        assert 0 < float(median.strip("*")) < 10
    assert len(p50) == 1
    # CPU is read in 10 ms ticks: a run of 50 requests may read 0, and a pair with a 0 in
    # every round is left out of the table.
    assert "### CPU per request, a / b per round" in report
    for line in cpu:
        *rounds, median, _, _ = line.strip("| ").split(" | ")[3:]
        assert len(rounds) == 2
        assert 0 <= float(median.strip("*")) < 100
    assert all(float(row["cpu_us_per_request"]) >= 0 for row in runs)
    assert sum(float(row["cpu_us_per_request"]) for row in runs) > 0
    assert "## CPU of the servers while they waited for their turn" in report
    idle = [line for line in report.splitlines() if line.startswith("| mlp-single") and "%" in line]
    assert len(idle) == 2


def test_the_restart_timeline_reads_each_step_after_the_kill_from_the_logs(
    tmp_path: Path,
) -> None:
    killed = 1_000.0

    def line(at: float, event: str) -> str:
        stamp = datetime.fromtimestamp(killed + at, UTC).isoformat(timespec="milliseconds")
        return orjson.dumps({"ts": stamp, "event": event}).decode()

    log = tmp_path / "server.log"
    events = [
        (-1.0, "model_ready"),  # the previous start
        (0.001, "engine_connected"),  # a front end reaching the dying engine once more
        (0.1, "engine_exited"),
        (0.2, "engine_process_started"),
        (1.5, "engine_imports_done"),
        (1.6, "engine_connected"),
        (1.7, "engine_connected"),
        (1.8, "model_warmed_up"),
        (1.9, "model_ready"),
    ]
    log.write_text("\n".join(["not json"] + [line(at, event) for at, event in events]) + "\n")
    # (answered, status, sent): the second, sent before the kill, was answered just after it.
    answers = [
        (killed - 0.5, 200, killed - 0.51),
        (killed + 0.005, 200, killed - 0.001),
        (killed + 0.5, 503, killed + 0.49),
        (killed + 1.0, 0, killed + 0.99),
        (killed + 2.0, 200, killed + 1.99),
    ]
    assert restart_timeline._timeline(log, answers, killed) == {
        "noticed": 0.1,
        "process_started": 0.2,
        "imported": 1.5,
        "warmed": 1.8,
        "ready": 1.9,
        "reconnected": 1.7,
        "first_answer": 2.0,
        "failed_requests": 2,
        "refused": 2,  # within 1 s before to 2 s after the kill
        "answered": 3,
        "longest_gap_s": 1.995,
    }


def test_the_embedding_benchmark_sends_texts_of_5_to_200_tokens() -> None:
    from tests.hf_folders import tokenizer

    texts = embeddings.texts(200, seed=3)
    lengths = [len(encoding.ids) for encoding in tokenizer().encode_batch(texts)]
    assert min(lengths) >= 5
    assert max(lengths) <= 200
    assert max(lengths) - min(lengths) > 100  # lengths of every bucket


def test_the_generation_benchmark_sends_prompts_of_16_to_32_tokens(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    folder = generation.save_folder(tmp_path, "tiny")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    lengths = [len(tokenizer.encode(text).ids) for text in generation.prompts(folder, 100, 3)]
    assert min(lengths) >= 16
    assert max(lengths) <= 32
    assert max(lengths) - min(lengths) > 8


@pytest.mark.slow
def test_the_generation_benchmark_measures_streams_of_the_tokens_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The smallest case end to end: the tiny GPT-2 served by batchserve, one round; the
    streams' requests ask for 24 to 40 tokens, a new request for 32."""
    argv = ["--model", "tiny", "--rounds", "1", "--duration-s", "1", "--streams", "1"]
    argv += ["--stream-tokens", "24", "40"]
    assert generation.main(argv) == 0
    report = capsys.readouterr().out
    rows = [
        line.strip("| ").split(" | ") for line in report.splitlines() if "| batchserve |" in line
    ]
    assert [row[0] for row in rows] == [
        "1 stream(s)",
        "a new request alone",
        f"a new request beside {generation.BACKGROUND_STREAMS} streams",
    ]
    for load, _, _rate, ttft50, ttft99, itl50, itl99, requests, tokens, errors in rows:
        assert errors == "0", load
        assert int(requests) >= 1, load
        if load.startswith("a new request"):  # ignore_eos: every token asked for
            assert float(tokens) == generation.NEW_TOKENS, load
        else:
            assert 24 <= float(tokens) <= 40, load
        assert 0 < float(ttft50) <= float(ttft99) < 120_000, load
        assert 0 < float(itl50) <= float(itl99) < 120_000, load
    assert float(rows[0][2].replace(",", "")) > 0
    assert float(rows[2][2].replace(",", "")) > 0
    ratio = f"- batchserve: TTFT p50 beside {generation.BACKGROUND_STREAMS} streams over alone"
    assert any(line.startswith(ratio) for line in report.splitlines())
