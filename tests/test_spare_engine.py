"""The spare engine interpreter (``spare_engine``): the supervisor keeps one process with torch
and the engine imported, which becomes the next engine it must start.

The policies are pure functions. The supervisor's handling of the spare runs on fake spare
and engine processes (``python -c``). The server tests share one real server, in order: a
kill -9 of the engine is answered by the former spare, with the model's own answers, and a
new spare is started; a spare killed is replaced while the engine serves on; SIGTERM leaves
no process behind. Timeouts for what is not the point (a spare's imports) are generous for a
busy 2-core machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from service.config import Settings
from service.engine.spare import backend_modules, engine_variables
from service.metrics import MULTIPROCESS_DIR_ENV
from service.processes import (
    ENGINE_HEARTBEAT_FILE_ENV,
    ENGINE_SOCKET_ENV,
    EXIT_LOAD_FAILED,
    READY_MARK,
    SPARE_READY,
    SPARE_TAKEN,
)
from service.server import spare_engine, supervisor
from service.server.child_processes import backoff_s
from service.server.spare_engine import FIRST_RETRY_S, LONGEST_RETRY_S, SpareEngine, spare_wanted
from service.server.supervisor import EngineProcess, Supervisor
from tests.processes import (
    Running,
    alive,
    children_of,
    engine_pids,
    logged,
    scraped,
    serve_with_engines,
    wait_for,
    wait_until_serving,
)

WORKERS = 2
DIGIT = {"instances": [[[0.5] * 8] * 8]}
#: A spare imports torch while the machine may be busy with other tests: tens of seconds.
SPARE_TIMEOUT_S = 180.0


# The policies.


def test_no_spare_starts_while_an_engine_loads_or_when_turned_off() -> None:
    assert spare_wanted(enabled=True, engines_loading=0)
    assert not spare_wanted(enabled=True, engines_loading=1)
    assert not spare_wanted(enabled=False, engines_loading=0)


def test_a_spare_that_keeps_dying_before_it_is_ready_waits_longer_each_time() -> None:
    def spare_retry_s(deaths_before_ready: int) -> float:
        return backoff_s(deaths_before_ready, FIRST_RETRY_S, LONGEST_RETRY_S)

    assert spare_retry_s(0) == 0.0  # one that was ready, then killed
    assert spare_retry_s(1) == 0.0
    assert spare_retry_s(2) == FIRST_RETRY_S
    assert spare_retry_s(3) == 2 * FIRST_RETRY_S
    assert spare_retry_s(50) == LONGEST_RETRY_S


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        pytest.param([("safetensors", "service.models.digits:Digits")], ["service.models.digits"]),
        pytest.param([("onnx", None), ("onnx", None)], ["onnxruntime"], id="onnx, once"),
        pytest.param(
            [("safetensors", "service.engine.hf_model:TransformersTextModel")],
            ["transformers.modeling_utils", "service.engine.hf_model"],
            id="transformers",
        ),
        pytest.param([("safetensors", "model:Net")], [], id="bundled code: read at load"),
        pytest.param([("torchscript", None)], [], id="torch alone"),
    ],
)
def test_the_spare_imports_what_the_served_models_need_beyond_the_engine(
    models: list[tuple[str, str | None]], expected: list[str]
) -> None:
    assert backend_modules(models) == expected


def test_the_spare_takes_only_a_json_object_of_strings() -> None:
    assert engine_variables(b'{"A": "1"}\n') == {"A": "1"}
    with pytest.raises(ValueError, match="JSON object of strings"):
        engine_variables(b'{"A": 1}\n')
    with pytest.raises(ValueError, match="JSON object of strings"):
        engine_variables(b'["A"]\n')


# The supervisor's handling, on fake processes.

#: A fake spare: ready at once; given its line, it writes its variables to its heartbeat file,
#: answers that it is taken and exits as an engine that cannot load.
SPARE_FAILING_AS_ENGINE = f"""
import json, os, sys
ready = int(sys.argv[1])
os.write(ready, {SPARE_READY!r})
variables = json.loads(sys.stdin.readline())
with open(variables["{ENGINE_HEARTBEAT_FILE_ENV}"], "w") as told:
    json.dump(variables, told)
os.write(ready, {SPARE_TAKEN!r})
sys.exit({EXIT_LOAD_FAILED})
"""
ENGINE_SERVING = "import time; time.sleep(60)"


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline_s = time.monotonic() + 30.0
    while not condition():
        assert time.monotonic() < deadline_s, f"not {what} in 30 s"
        time.sleep(0.05)


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        spare_engine,
        "spare_command",
        lambda fd: [sys.executable, "-c", SPARE_FAILING_AS_ENGINE, str(fd)],
    )
    monkeypatch.setattr(
        supervisor, "engine_command", lambda: [sys.executable, "-c", ENGINE_SERVING]
    )


@pytest.mark.usefixtures("fakes")
def test_the_spare_becomes_the_engine_with_its_variables_and_fails_as_an_engine_does(
    tmp_path: Path,
) -> None:
    engine = EngineProcess(0, "cpu", tmp_path / "engine.sock", tmp_path / "engine.alive")
    watcher = Supervisor(Settings(), {**os.environ, MULTIPROCESS_DIR_ENV: str(tmp_path)}, [engine])
    spare = watcher._spare
    try:
        spare.watch(engines_loading=0)  # none yet: started
        spare_process = spare.process
        assert spare_process is not None

        def ready() -> bool:
            spare.watch(engines_loading=0)  # reads its ready pipe
            return spare.ready

        _wait(ready, "the spare ready")
        watcher._start(engine, standby=False)
        assert engine.process is spare_process  # the same process, watched as the engine
        assert spare.process is None
        assert engine.process.wait(timeout=30.0) == EXIT_LOAD_FAILED
        told = orjson.loads(engine.heartbeat_file.read_bytes())
        assert told[ENGINE_SOCKET_ENV] == str(engine.socket)
        # As an engine that cannot load: the server stops (here: the stop begins).
        watcher._gunicorn = spare_process  # exited: nothing to forward the stop to
        watcher._watch_engines()
        assert watcher._stopping
        assert watcher._exit_status == 1
    finally:
        spare.stop()
        if engine.process is not None and engine.alive:
            engine.process.kill()
            engine.process.wait()


@pytest.mark.usefixtures("fakes")
def test_without_a_spare_alive_the_engine_starts_fresh_and_a_dead_spare_is_replaced(
    tmp_path: Path,
) -> None:
    engine = EngineProcess(0, "cpu", tmp_path / "engine.sock", tmp_path / "engine.alive")
    spare = SpareEngine({**os.environ})
    try:
        spare.watch(engines_loading=0)
        first = spare.process
        assert first is not None
        first.kill()
        first.wait()
        engine.start(dict(os.environ), 0, False, spare)
        assert engine.process is not first  # started fresh
        assert engine.alive
        spare.watch(engines_loading=1)  # its death noticed; none new while an engine loads
        assert spare.process is None
        spare.watch(engines_loading=0)
        assert spare.process is not None
        assert spare.process is not first
    finally:
        spare.stop()
        if engine.process is not None:
            engine.process.kill()
            engine.process.wait()


def ready_spare_of(spare: SpareEngine) -> subprocess.Popen[bytes]:
    """Start ``spare``'s process and wait until it is ready."""

    def ready() -> bool:
        spare.watch(engines_loading=0)  # starts it, then reads its ready pipe
        return spare.ready

    _wait(ready, "the spare ready")
    assert spare.process is not None
    return spare.process


@pytest.mark.usefixtures("fakes")
def test_a_stopped_spare_is_killed_when_taken_and_the_engine_started_fresh(
    tmp_path: Path,
) -> None:
    """A spare stopped while it waited never answers its line: handed the engine's place, it
    would hold it for good, never beating, never serving."""
    engine = EngineProcess(0, "cpu", tmp_path / "engine.sock", tmp_path / "engine.alive")
    spare = SpareEngine({**os.environ}, answer_timeout_s=0.5)
    stopped = ready_spare_of(spare)
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        engine.start(dict(os.environ), 0, False, spare)
        assert engine.process is not stopped  # started fresh
        assert stopped.poll() == -signal.SIGKILL  # killed, and reaped
        assert spare.process is None  # a new one is started once no engine loads
        assert engine.alive
    finally:
        if stopped.poll() is None:
            stopped.kill()
            stopped.wait()
        spare.stop()
        if engine.process is not None and engine.alive:
            engine.process.kill()
            engine.process.wait()


@pytest.mark.usefixtures("fakes")
def test_a_spare_that_answers_becomes_the_engine_with_what_it_wrote_kept(
    tmp_path: Path,
) -> None:
    engine = EngineProcess(0, "cpu", tmp_path / "engine.sock", tmp_path / "engine.alive")
    spare = SpareEngine({**os.environ}, answer_timeout_s=30.0)
    answering = ready_spare_of(spare)
    try:
        engine.start(dict(os.environ), 0, False, spare)
        assert engine.process is answering
        # What it wrote into its heartbeat file before it answered is still there.
        told = orjson.loads(engine.heartbeat_file.read_bytes())
        assert told[ENGINE_SOCKET_ENV] == str(engine.socket)
        assert answering.wait(timeout=30.0) == EXIT_LOAD_FAILED
    finally:
        spare.stop()
        if answering.poll() is None:
            answering.kill()
            answering.wait()


def test_turned_off_no_spare_is_ever_started(tmp_path: Path) -> None:
    spare = SpareEngine({**os.environ}, enabled=False)
    spare.watch(engines_loading=0)
    assert spare.process is None
    assert spare.take({}) is None


# A real spare.


@pytest.mark.slow
def test_a_spare_taken_before_its_imports_finish_becomes_the_engine(tmp_path: Path) -> None:
    """Told its engine before it is ready (an engine died soon after the last restart): it
    finishes its imports, loads and serves, though nobody reads its ready pipe any more."""
    engine = EngineProcess(0, "cpu", tmp_path / "engine.sock", tmp_path / "engine.alive")
    environ = {**os.environ, MULTIPROCESS_DIR_ENV: str(tmp_path), "BATCHSERVE_DEVICE": "cpu"}
    spare = SpareEngine(environ)
    try:
        spare.watch(engines_loading=0)
        spare_process = spare.process
        engine.start(environ, 0, False, spare)
        assert spare_process is not None
        assert engine.process is spare_process
        assert not spare.ready  # imports take seconds: taken long before
        deadline_s = time.monotonic() + SPARE_TIMEOUT_S
        while engine.mark() != READY_MARK:
            assert engine.alive, f"the engine exited {engine.process.returncode}"
            assert time.monotonic() < deadline_s, "the engine never loaded"
            time.sleep(0.1)
    finally:
        spare.stop()
        if engine.process is not None and engine.alive:
            engine.process.terminate()
            engine.process.wait(timeout=30.0)


# A real server.


def ready_spare(server: Running) -> int:
    """The pid of the spare that is ready now (waiting for one)."""

    def spare_ready() -> bool:
        ready = logged(server, "spare_engine_ready")
        taken = {record["pid"] for record in logged(server, "spare_engine_taken")}
        return bool(ready) and ready[-1]["pid"] not in taken and alive(int(str(ready[-1]["pid"])))

    wait_for(spare_ready, "a spare ready", server, SPARE_TIMEOUT_S)
    return int(str(logged(server, "spare_engine_ready")[-1]["pid"]))


#: How much longer than the outage a client saw a front end's takeover may be timed: from the
#: engine's last heartbeat (up to engine_heartbeat_interval_s before the kill) to when that
#: front end, not the one that answered first, reached the new engine.
TAKEOVER_SLACK_S = 1.0


def takeover_timed_as_the_outage(server: Running, victim: int, outage_s: float) -> None:
    """Each front end timed the takeover from ``victim`` as about ``outage_s`` (from the kill
    to the first 200), in its log and in ``batchserve_engine_takeover_seconds``; before, from
    the victim's last status change: when it became ready, seconds to minutes earlier."""
    timed = [
        float(record["takeover_s"])
        for record in logged(server, "engine_takeover")
        if record["from_pid"] == victim
    ]
    print(f"\nkill -9, no standby: outage {outage_s:.3f} s, takeovers timed {timed}")
    assert len(timed) == WORKERS
    assert all(0 < seconds <= outage_s + TAKEOVER_SLACK_S for seconds in timed), timed
    observed = scraped(server.url, "batchserve_engine_takeover_seconds_sum")
    assert scraped(server.url, "batchserve_engine_takeover_seconds_count") == WORKERS
    assert observed == pytest.approx(sum(timed), abs=1e-3)


def lone_answer(url: str) -> np.ndarray:
    reply = httpx.post(url + "/predict", json=DIGIT, timeout=10.0)
    assert reply.status_code == 200, reply.text
    return np.asarray(reply.json()["predictions"])


def serving_again(url: str) -> bool:
    try:
        return httpx.post(url + "/predict", json=DIGIT, timeout=10.0).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with serve_with_engines(tmp_path_factory.mktemp("spare"), WORKERS) as running:
        wait_until_serving(running, WORKERS)
        yield running


@pytest.mark.slow
def test_a_killed_engine_is_replaced_by_the_spare_which_serves_the_models_answers(
    server: Running,
) -> None:
    reference = lone_answer(server.url)
    spare = ready_spare(server)
    (victim,) = engine_pids(server)
    os.kill(victim, signal.SIGKILL)
    killed_s = time.monotonic()
    wait_for(lambda: serving_again(server.url), "serving again", server, SPARE_TIMEOUT_S)
    outage_s = time.monotonic() - killed_s
    assert engine_pids(server) == [spare]  # the spare, imported long before the kill
    takeover_timed_as_the_outage(server, victim, outage_s)
    for _ in range(5):
        np.testing.assert_allclose(lone_answer(server.url), reference, rtol=1e-5, atol=1e-6)
    started = logged(server, "engine_process_started")[-1]
    assert started["pid"] == spare
    # A new spare, once the engine has loaded.
    assert ready_spare(server) != spare


@pytest.mark.slow
def test_a_killed_spare_is_replaced_while_the_engine_serves_on(server: Running) -> None:
    (engine,) = engine_pids(server)
    spare = ready_spare(server)
    os.kill(spare, signal.SIGKILL)
    wait_for(
        lambda: any(r["pid"] == spare for r in logged(server, "spare_engine_exited")),
        "the spare's death noticed",
        server,
    )
    lone_answer(server.url)  # answered 200
    assert ready_spare(server) != spare
    assert engine_pids(server) == [engine]
    assert len(logged(server, "engine_exited")) == 1  # the engine of the test before


@pytest.mark.slow
def test_sigterm_stops_the_spare_with_everything_else(server: Running) -> None:
    spare = ready_spare(server)
    everyone = [server.process.pid]
    for pid in everyone:
        everyone.extend(children_of(pid))
    assert spare in everyone
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=60.0) == 0
    wait_for_gone = time.monotonic() + 30.0
    while any(alive(pid) for pid in everyone) and time.monotonic() < wait_for_gone:
        time.sleep(0.1)
    assert not [pid for pid in everyone if alive(pid)]
