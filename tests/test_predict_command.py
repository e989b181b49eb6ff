"""``batchserve predict``: a file's rows answered in process, each as ``/predict`` answers it.

Every answer and every error is compared with what ``/predict`` of a one-process server
(``server.single.create_app``, the same settings) answers for a body holding that row alone.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.engine.model_store import ModelStore
from service.manifest import HandlerSpec
from service.packaging.package import Packager
from service.processes import EXIT_STALLED
from service.server.cli import main
from service.server.predict_command import file_defaults
from service.server.predicting.progress import BAR_WIDTH, Progress
from service.server.predicting.run import BATCHES_PER_CHUNK
from service.server.single import create_app
from tests.digits_versions import add_digits_version, copy_bundled_digits
from tests.fixtures import lifespan
from tests.torch_models import FEATURES, HANG_VALUE, package_hanging_model

DIGITS = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("digits")
SENTIMENT = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("sentiment")
#: More rows than two chunks of the default max_batch_size (64), the last one short.
ROWS = 150
TEXTS = [
    "a wonderful, moving film",
    "dull and far too long",
    "",
    "not bad at all",
    "the worst acting I have seen " * 40,
    "fine",
]


def digit_rows(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((count, 8, 8), dtype=np.float32)


def write_jsonl(path: Path, values: Sequence[object]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(value) + b"\n" for value in values))
    return path


def predict(*args: str | Path) -> int:
    """``batchserve predict`` with ``args``: its exit status."""
    return main(["predict", *(str(arg) for arg in args)])


def records(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def served_answers(
    bodies: Sequence[tuple[bytes, str]], model: str = "digits", repository: Path | None = None
) -> list[httpx.Response]:
    """``/predict``'s answer to each body (content, content type) alone, one after another."""

    async def ask() -> list[httpx.Response]:
        values: dict[str, Any] = {"device": "cpu", "model_name": model}
        if repository is not None:
            values["model_repository"] = repository
        app = create_app(Settings(**values))
        async with lifespan(app):
            await app.state.loading
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return [
                    await client.post("/predict", content=body, headers={"content-type": kind})
                    for body, kind in bodies
                ]

    return asyncio.run(ask())


def json_bodies(instances: Sequence[bytes]) -> list[tuple[bytes, str]]:
    """A ``/predict`` JSON body for each instance alone (given as its JSON text)."""
    return [(b'{"instances":[' + instance + b"]}", "application/json") for instance in instances]


def npy_body(row: np.ndarray) -> tuple[bytes, str]:
    buffer = io.BytesIO()
    np.save(buffer, row[np.newaxis])
    return buffer.getvalue(), "application/x-npy"


def assert_same_answers(got: list[dict[str, Any]], answers: list[httpx.Response]) -> None:
    """Row by row, each record is ``/predict``'s answer to that row alone."""
    assert [record["row"] for record in got] == list(range(len(answers)))
    for record, answer in zip(got, answers, strict=True):
        assert_same_answer(record, answer)


def assert_same_answer(record: dict[str, Any], answer: httpx.Response) -> None:
    """The prediction, or the error's status, code and message, of ``/predict``'s answer;
    the model and version that computed it (its ``X-Model-Version``) recorded in the row."""
    if answer.status_code != 200:
        error = answer.json()["error"]
        assert record["error"] == {
            "status": answer.status_code,
            "code": error["code"],
            "message": error["message"],
        }, record["row"]
        return
    assert "error" not in record, record
    assert f"{record['model']}@{record['version']}" == answer.headers["x-model-version"]
    assert_close(record["prediction"], answer.json()["predictions"][0])


def assert_close(got: Any, expected: Any) -> None:
    """Equal, numbers within float32 batching noise (a row's forward in a batch of 64 and
    alone take different kernels)."""
    if isinstance(expected, list) and expected and isinstance(expected[0], dict):
        assert [item["label"] for item in got] == [item["label"] for item in expected]
        got = [item["score"] for item in got]
        expected = [item["score"] for item in expected]
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_jsonl_rows_are_answered_as_predict_answers_each_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = digit_rows(ROWS)
    instances = [orjson.dumps(row.tolist()) for row in rows]
    instances[3] = orjson.dumps({"image": rows[3].tolist()})  # an object keyed by input name
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\n".join(instances))  # the last line without a newline
    output = tmp_path / "out.jsonl"

    status = predict("--model", "digits", "--input", source, "--output", output)

    assert status == 0, capsys.readouterr().err
    got = records(output)
    assert_same_answers(got, served_answers(json_bodies(instances)))
    assert {(record["model"], record["version"]) for record in got} == {("digits", DIGITS.version)}
    summary = capsys.readouterr().err
    assert f"digits@{DIGITS.version} answered {ROWS} rows" in summary
    assert f"{ROWS} ok, 0 failed" in summary


def test_bad_rows_get_the_errors_predict_gives_them_and_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = [orjson.dumps(row.tolist()) for row in digit_rows(70)]
    outside = digit_rows(1, seed=1)[0]
    outside[2, 3] = 1.5
    bad = {
        1: b"[1, 2]",  # a wrong shape: 422
        5: orjson.dumps(outside.tolist()),  # a value outside [0, 1]: 422
        9: b"[[0.5, ",  # not JSON: 400
        20: b"",  # an empty line: 400
        # Two valid instances on one line: one row is one instance (400), never two answers.
        40: good[40] + b", " + good[41],
        66: b'{"image": [[0.5]], "extra": 1}',  # an unknown input: 422
    }
    lines = [bad.get(index, line) for index, line in enumerate(good)]
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    output = tmp_path / "out.jsonl"

    status = predict("--model", "digits", "--input", source, "--output", output)

    assert status == 3  # some rows failed
    got = records(output)
    assert [record["row"] for record in got] == list(range(len(lines)))
    not_one_value = (9, 20, 40)  # /predict would read another body than the row
    for index in not_one_value:
        assert got[index]["error"]["status"] == 400
        assert got[index]["error"]["code"] == "bad_request"
        assert "one JSON instance" in got[index]["error"]["message"]
    others = [index for index in range(len(lines)) if index not in not_one_value]
    answers = served_answers(json_bodies([lines[index] for index in others]))
    assert [answer.status_code for answer in answers].count(422) == 3
    for index, answer in zip(others, answers, strict=True):
        assert got[index]["model"] == "digits"
        assert got[index]["version"] == DIGITS.version
        assert_same_answer(got[index], answer)
    summary = capsys.readouterr().err
    assert f"{len(lines) - len(bad)} ok, {len(bad)} failed" in summary
    assert "row 1: 422 expected instances of shape (N, 8, 8)" in summary

    again = tmp_path / "again.jsonl"
    assert predict("--model", "digits", "--input", source, "--output", again, "--allow-errors") == 0
    assert again.read_bytes().count(b'"error"') == len(bad)


def test_npy_and_npz_rows_are_answered_as_predict_answers_each_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = digit_rows(ROWS, seed=2)
    rows[7, 0, 0] = np.nan  # refused alone (422); its chunk's other rows are answered
    np.save(tmp_path / "in.npy", rows.astype(">f4"))  # big-endian: read as /predict reads it
    with zipfile.ZipFile(tmp_path / "in.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        buffer = io.BytesIO()
        np.save(buffer, rows)
        archive.writestr("image.npy", buffer.getvalue())  # inflated as it is read

    answers = served_answers([npy_body(row) for row in rows])
    assert answers[7].status_code == 422
    for name in ("in.npy", "in.npz"):
        output = tmp_path / f"{name}.jsonl"
        status = predict("--model", "digits", "--input", tmp_path / name, "--output", output)
        assert status == 3, capsys.readouterr().err
        assert_same_answers(records(output), answers)


def test_text_lines_and_json_strings_with_a_text_handler(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "in.txt").write_text("".join(text + "\r\n" for text in TEXTS), encoding="utf-8")
    write_jsonl(tmp_path / "in.jsonl", TEXTS)

    answers = served_answers(json_bodies([orjson.dumps(text) for text in TEXTS]), "sentiment")
    assert {answer.status_code for answer in answers} == {200}
    for name in ("in.txt", "in.jsonl"):
        output = tmp_path / f"{name}.out"
        status = predict("--model", "sentiment", "--input", tmp_path / name, "--output", output)
        assert status == 0, capsys.readouterr().err
        got = records(output)
        assert_same_answers(got, answers)
        assert {record["version"] for record in got} == {SENTIMENT.version}


def test_parquet_columns_by_input_name_or_one_column_of_texts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    rows = digit_rows(ROWS, seed=3)
    table = pyarrow.table({"id": list(range(ROWS)), "image": [row.tolist() for row in rows]})
    parquet.write_table(table, tmp_path / "digits.parquet", row_group_size=50)
    parquet.write_table(pyarrow.table({"review": TEXTS}), tmp_path / "texts.parquet")

    output = tmp_path / "digits.jsonl"
    source = tmp_path / "digits.parquet"
    status = predict("--model", "digits", "--input", source, "--output", output)
    assert status == 0, capsys.readouterr().err
    assert_same_answers(records(output), served_answers([npy_body(row) for row in rows]))

    output = tmp_path / "texts.jsonl"
    status = predict(
        "--model", "sentiment", "--input", tmp_path / "texts.parquet", "--output", output
    )
    assert status == 0, capsys.readouterr().err
    texts = [orjson.dumps(text) for text in TEXTS]
    assert_same_answers(records(output), served_answers(json_bodies(texts), "sentiment"))

    parquet.write_table(pyarrow.table({"blob": [b"\x00\x01", b"\x02"]}), tmp_path / "bytes.parquet")
    output = tmp_path / "bytes.jsonl"
    status = predict("--model", "digits", "--input", tmp_path / "bytes.parquet", "--output", output)
    assert status == 3
    for record in records(output):
        assert record["error"]["status"] == 400
        assert "cannot be an instance as JSON" in record["error"]["message"]


def test_parquet_without_pyarrow_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "in.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if missing

    output = tmp_path / "out.jsonl"
    status = predict("--model", "digits", "--input", tmp_path / "in.parquet", "--output", output)

    assert status == 2
    assert "pip install 'batchserve[batch]'" in capsys.readouterr().err
    assert not output.exists()


@pytest.mark.parametrize(
    ("model", "name", "content", "message"),
    [
        ("digits", "in.txt", b"some text\n", "txt rows need a model that reads text/plain"),
        (
            "sentiment",
            "in.npz",
            {"input_ids": np.ones((2, 4), np.int64), "attention_mask": np.ones((2, 4), np.int64)},
            "has a handler of its own (TextHandler)",
        ),
        ("digits", "in.csv", b"1,2\n", "cannot tell the format from the suffix '.csv'"),
        ("digits", "in.npy", np.zeros((2, 8, 8)), "input 'image' must be float32, got float64"),
        ("digits", "in.npy", np.zeros((2, 8, 7), np.float32), "must be shaped (8, 8)"),
        ("digits", "in.npz", {"pixels": np.zeros((2, 8, 8), np.float32)}, "exactly the arrays"),
        ("digits", "in.npy", np.array([{}, {}]), "never unpickled"),
    ],
)
def test_a_file_no_row_of_which_the_model_can_read_is_refused_before_any_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: str,
    name: str,
    content: object,
    message: str,
) -> None:
    source = tmp_path / name
    if isinstance(content, bytes):
        source.write_bytes(content)
    elif isinstance(content, dict):
        np.savez(source, **content)
    else:
        np.save(source, content)
    output = tmp_path / "out.jsonl"

    status = predict("--model", model, "--input", source, "--output", output)

    assert status == 2
    assert message in capsys.readouterr().err
    assert not output.exists()


def assert_same_records(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """The same rows, models, versions and predictions (within batching noise)."""
    assert [(r["row"], r["model"], r["version"]) for r in got] == [
        (r["row"], r["model"], r["version"]) for r in expected
    ]
    for record, reference in zip(got, expected, strict=True):
        assert_close(record["prediction"], reference["prediction"])


def test_resume_keeps_the_complete_lines_drops_a_torn_one_and_appends_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [row.tolist() for row in digit_rows(ROWS, 4)])
    whole = tmp_path / "whole.jsonl"
    assert predict("--model", "digits", "--input", source, "--output", whole) == 0
    lines = whole.read_bytes().splitlines(keepends=True)
    partial = tmp_path / "partial.jsonl"
    partial.write_bytes(b"".join(lines[:70]))
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(b"".join(lines[:100]) + lines[100][:37])
    capsys.readouterr()

    for output, kept in ((partial, 70), (torn, 100)):
        status = predict("--model", "digits", "--input", source, "--output", output, "--resume")
        assert status == 0
        assert output.read_bytes().startswith(b"".join(lines[:kept]))
        assert_same_records(records(output), records(whole))
        summary = capsys.readouterr().err
        assert f"answered {ROWS - kept} rows" in summary
        assert f"holds {ROWS} rows ({kept} kept from before): {ROWS} ok, 0 failed" in summary

    fresh = tmp_path / "fresh.jsonl"  # nothing to resume: a run from the first row
    assert predict("--model", "digits", "--input", source, "--output", fresh, "--resume") == 0
    assert_same_records(records(fresh), records(whole))


def test_resume_refuses_an_output_it_did_not_write_for_this_model_version_and_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repository = tmp_path / "repository"
    copy_bundled_digits(repository)
    source = write_jsonl(tmp_path / "in.jsonl", [row.tolist() for row in digit_rows(10, 5)])
    output = tmp_path / "out.jsonl"
    common = ("--repository", repository, "--input", source, "--output", output)
    assert predict("--model", "digits", *common) == 0
    written = output.read_bytes()
    newer = add_digits_version(repository, bias_shift=1.0)  # now "latest"
    capsys.readouterr()

    assert predict("--model", "digits", *common) == 2
    assert "exists: pass --resume to continue it" in capsys.readouterr().err

    assert predict("--model", "digits", *common, "--resume") == 2
    assert (
        f"was written by digits@{DIGITS.version} (line 1); this run uses digits@{newer}: "
        f"resume it with --model digits --version {DIGITS.version}"
    ) in capsys.readouterr().err
    assert output.read_bytes() == written

    first = written.splitlines(keepends=True)[0]
    output.write_bytes(first + first.replace(b'"row":0', b'"row":2'))
    assert predict("--model", "digits", *common, "--version", DIGITS.version, "--resume") == 2
    assert "line 2 of" in capsys.readouterr().err

    short = write_jsonl(tmp_path / "short.jsonl", [digit_rows(1)[0].tolist()])
    output.write_bytes(written)
    assert (
        predict("--model", "digits", "--repository", repository, "--version", DIGITS.version,
                "--input", short, "--output", output, "--resume")
        == 2
    )  # fmt: skip
    assert "holds 10 rows, more than the 1 of" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(("stop", "status"), [(signal.SIGKILL, -9), (signal.SIGINT, 130)])
def test_a_run_stopped_leaves_only_valid_lines_and_resume_completes_it(
    tmp_path: Path, stop: signal.Signals, status: int
) -> None:
    rows = digit_rows(10_000, seed=6)
    command, output = digits_command(tmp_path, rows)
    environment = {**os.environ, "BATCHSERVE_DEVICE": "cpu"}
    run = slow_run_under_way(command, output)
    try:
        run.send_signal(stop)
        _, stderr = run.communicate(timeout=60)
    finally:
        run.kill()
        run.wait()
    assert run.returncode == status
    written = output.read_bytes()
    complete = written[: written.rfind(b"\n") + 1]
    if stop == signal.SIGINT:  # every chunk answered is written whole
        assert complete == written
        lines = complete.count(b"\n")
        said = f"interrupted; {lines:,} rows in {output}, resume with --resume"
        assert said in stderr.decode()
    assert 100 <= complete.count(b"\n") < len(rows)
    assert [record["row"] for record in records_of(complete)] == list(range(complete.count(b"\n")))

    resumed = subprocess.run([*command, "--resume"], env=environment, capture_output=True)

    assert resumed.returncode == 0, resumed.stderr.decode()
    assert output.read_bytes().startswith(complete)
    got = records(output)
    assert [record["row"] for record in got] == list(range(len(rows)))
    assert {(record["model"], record["version"]) for record in got} == {("digits", DIGITS.version)}
    sample = [0, 99, len(got) // 2, len(got) - 1]
    answers = served_answers([npy_body(rows[index]) for index in sample])
    for index, answer in zip(sample, answers, strict=True):
        assert_same_answer(got[index], answer)


def test_weights_that_fail_their_check_end_the_run_before_any_row_with_the_reason(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    repository = tmp_path / "models"
    copy_bundled_digits(repository)
    weights = repository / "digits" / DIGITS.version / DIGITS.artifact
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of a tensor flipped: the file no longer has its hash
    weights.write_bytes(bytes(data))
    source = write_jsonl(tmp_path / "in.jsonl", digit_rows(3).tolist())
    output = tmp_path / "out.jsonl"

    status = predict("--model", "digits", "--repository", repository, "--input", source,
                     "--output", output)  # fmt: skip

    assert status == 1
    assert not output.exists()
    printed = capfd.readouterr()
    # The engine's log line (which file, which hash) is on stderr: stdout may be the output
    # itself. (This process's own log goes where an earlier test may have configured it.)
    assert "refusing to load" in printed.err
    assert "refusing to load" not in printed.out
    # The command's own last word: the engine's reason when its failed status arrives before
    # its exit, else that it exited (the two race; both name where the reason is).
    said = [line for line in printed.err.splitlines() if line.startswith("batchserve")]
    assert len(said) == 1, printed.err
    assert (
        "refusing to load" in said[0]
        or "the engine process exited before it served the model" in said[0]
    ), said[0]


@pytest.mark.slow
def test_an_engine_killed_mid_run_ends_it_with_its_answers_kept_and_no_row_failed(
    tmp_path: Path,
) -> None:
    rows = digit_rows(10_000, seed=7)
    command, output = digits_command(tmp_path, rows)
    run = slow_run_under_way(command, output)
    try:
        (engine,) = child_pids(run.pid)
        os.kill(engine, signal.SIGKILL)
        _, stderr = run.communicate(timeout=60)
    finally:
        run.kill()
        run.wait()

    assert run.returncode == 1, stderr.decode()
    written = output.read_bytes()
    lines = written.count(b"\n")
    said = f"the engine process was killed (SIGKILL); {lines:,} rows in {output}, resume with"
    assert said in stderr.decode()
    got = records_of(written)  # every line whole, none an error of the engine's loss
    assert [record["row"] for record in got] == list(range(lines))
    assert all("prediction" in record for record in got)
    assert lines < len(rows)


def digits_command(tmp_path: Path, rows: np.ndarray) -> tuple[list[str], Path]:
    """``batchserve predict`` over ``rows`` saved as ``.npy``, and its output's path."""
    source = tmp_path / "in.npy"
    np.save(source, rows)
    output = tmp_path / "out.jsonl"
    command = [
        sys.executable, "-m", "service.server.cli", "predict", "--model", "digits",
        "--input", str(source), "--output", str(output),
    ]  # fmt: skip
    return command, output


def slow_run_under_way(command: list[str], output: Path) -> subprocess.Popen[bytes]:
    """``command`` started with batches of one row, slow enough to be stopped half-way
    through, once it has written 100 rows; killed if it cannot get there."""
    slow = {**os.environ, "BATCHSERVE_DEVICE": "cpu", "BATCHSERVE_MAX_BATCH_SIZE": "1"}
    run = subprocess.Popen(command, env=slow, stderr=subprocess.PIPE)
    try:
        deadline_s = time.monotonic() + 120
        while not (output.exists() and output.read_bytes().count(b"\n") >= 100):
            assert run.poll() is None, "the run ended before it could be stopped"
            assert time.monotonic() < deadline_s, "no 100 rows written within 120 s"
            time.sleep(0.05)
    except BaseException:
        run.kill()
        run.wait()
        raise
    return run


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            children.append(int(entry.name))
    return children


def records_of(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in data.splitlines()]


def test_answers_a_handler_cannot_write_as_json_are_each_rows_500(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repository = tmp_path / "repository"
    weights = BUNDLED_MODEL_REPOSITORY / "digits" / DIGITS.version / DIGITS.artifact
    Packager(repository).package(
        name="sets",
        artifact=weights,
        format="safetensors",
        architecture=DIGITS.architecture,
        inputs=DIGITS.inputs,
        outputs=DIGITS.outputs,
        handler=HandlerSpec(import_path="tests.fixtures:AnswersValuesJsonCannotHold"),
    )
    source = write_jsonl(tmp_path / "in.jsonl", [row.tolist() for row in digit_rows(3)])
    output = tmp_path / "out.jsonl"

    status = predict(
        "--model", "sets", "--repository", repository, "--input", source, "--output", output
    )

    assert status == 3
    for record in records(output):
        assert record["error"]["status"] == 500
        assert record["error"]["code"] == "handler_failed"
        assert "a value JSON cannot hold" in record["error"]["message"]
    assert "0 ok, 3 failed" in capsys.readouterr().err


@pytest.mark.slow
def test_a_model_that_hangs_ends_the_run_with_the_stalled_status(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    gate = tmp_path / "gate"  # the model hangs on HANG_VALUE while this file exists
    gate.touch()
    package_hanging_model(repository, gate)
    chunk = BATCHES_PER_CHUNK * Settings().max_batch_size  # a request: answered at once
    rows = [[1.0] * FEATURES] * (chunk + 100) + [[HANG_VALUE] * FEATURES] + [[2.0] * FEATURES] * 10
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    command = [
        sys.executable, "-m", "service.server.cli", "predict", "--model", "hangs",
        "--repository", str(repository), "--input", str(source), "--output", str(output),
    ]  # fmt: skip
    environment = {
        **os.environ,
        "BATCHSERVE_DEVICE": "cpu",
        "BATCHSERVE_STALL_TIMEOUT_S": "1",
        # A batch at a time: a run of batches would hold the first chunk's with the hanging one.
        "BATCHSERVE_MAX_RUN_MS": "0",
    }
    try:
        run = subprocess.run(command, env=environment, capture_output=True, timeout=120)
    finally:
        gate.unlink()

    assert run.returncode == EXIT_STALLED, run.stderr.decode()
    assert (
        f"ran longer than stall_timeout_s (1 s): the model hangs; {chunk:,} rows in {output}, "
        "resume with --resume"
    ) in run.stderr.decode()
    got = records(output)  # the chunk before the hanging row's, whole
    assert [record["row"] for record in got] == list(range(chunk))
    assert {tuple(record["prediction"]) for record in got} == {(3.0,) * FEATURES}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_redrawn_on_a_terminal_and_lines_in_a_log() -> None:
    terminal = Terminal()
    bar = Progress(total=40, done=10, stream=terminal)
    bar.interval_s = 3600.0  # no update is due: only the last state is drawn
    bar.start()
    bar.update(20)
    assert terminal.getvalue() == ""
    bar.update(40)
    bar.finish()
    drawn = terminal.getvalue()
    assert drawn.startswith("\r[" + "#" * BAR_WIDTH + "] 40/40 rows (100%), ")
    assert drawn.endswith("rows/s, 0 s left\x1b[K\n")

    log = io.StringIO()
    lines = Progress(total=40, done=0, stream=log)
    lines.interval_s = 0.0  # every update is due
    lines.update(10)
    lines.finish()  # a log's last state is the summary's
    assert log.getvalue().startswith("batchserve predict: 10/40 rows (25%), ")
    assert log.getvalue().count("\n") == 1


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".parquet", ".txt"])
def test_resume_skips_the_rows_written_in_every_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    rows = digit_rows(ROWS, seed=7)
    source = tmp_path / f"in{suffix}"
    model = "digits"
    if suffix == ".npy":
        np.save(source, rows)
    elif suffix == ".npz":
        np.savez_compressed(source, image=rows)
    elif suffix == ".parquet":
        pyarrow = pytest.importorskip("pyarrow")
        parquet = pytest.importorskip("pyarrow.parquet")
        table = pyarrow.table({"image": [row.tolist() for row in rows]})
        parquet.write_table(table, source, row_group_size=40)  # skipped across row groups
    else:
        model = "sentiment"
        source.write_text("".join(f"text number {index}\n" for index in range(ROWS)))
    whole = tmp_path / "whole.jsonl"
    assert predict("--model", model, "--input", source, "--output", whole) == 0
    output = tmp_path / "out.jsonl"
    output.write_bytes(b"".join(whole.read_bytes().splitlines(keepends=True)[:83]))

    status = predict("--model", model, "--input", source, "--output", output, "--resume")

    assert status == 0, capsys.readouterr().err
    assert f"answered {ROWS - 83} rows" in capsys.readouterr().err
    assert_same_records(records(output), records(whole))


def test_parquet_columns_that_miss_an_input_are_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    source = tmp_path / "in.parquet"
    parquet.write_table(pyarrow.table({"input_ids": [[2, 7, 3]], "id": [1]}), source)
    output = tmp_path / "out.jsonl"

    status = predict("--model", "sentiment_tensors", "--input", source, "--output", output)

    assert status == 2
    assert "has columns ['input_ids'] but not ['attention_mask']" in capsys.readouterr().err
    assert not output.exists()


def test_predict_logs_warnings_and_never_waits_for_batch_mates_unless_told_otherwise() -> None:
    assert file_defaults({}) == {"log_level": "warning", "max_wait_ms": 0.0}
    assert file_defaults({"BATCHSERVE_MAX_WAIT_MS": "5"}) == {"log_level": "warning"}
    assert file_defaults({"BATCHSERVE_LOG_LEVEL": "info", "BATCHSERVE_MAX_WAIT_MS": "5"}) == {}
