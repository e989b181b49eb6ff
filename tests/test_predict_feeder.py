"""``batchserve predict``'s feeder: rows read, prepared and written outside the event loop,
whose steps stay short while it does; lines written in bulk byte for byte as one record each.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.config import BUNDLED_MODEL_REPOSITORY, Settings
from service.engine.model_store import ModelStore
from service.server.predicting.output_file import OutputFile, answer_lines
from service.server.predicting.progress import Progress
from service.server.predicting.rows import _balanced_without_strings
from service.server.predicting.run import predict_file
from service.server.predicting.sources import ArrayRows
from tests.fixtures import SourceReadWhileTheLoopRuns

DIGITS = ModelStore(BUNDLED_MODEL_REPOSITORY).resolve("digits")
#: How long the event loop may leave a callback waiting while a chunk is read: far longer
#: than any of its steps, however busy the machine.
LOOP_TURN_LIMIT_S = 10.0


def test_chunks_are_read_while_the_event_loop_goes_on_running(tmp_path: Path) -> None:
    rows = np.random.default_rng(0).random((150, 8, 8), dtype=np.float32)
    chunks = [ArrayRows(start, {"image": rows[start : start + 64]}) for start in (0, 64, 128)]
    path = tmp_path / "out.jsonl"
    output = OutputFile(path, resume=False, model="digits", version=DIGITS.version)
    overrides = {"device": "cpu", "model_name": "digits", "model_version": DIGITS.version}
    settings = Settings(**overrides)

    async def run() -> SourceReadWhileTheLoopRuns:
        source = SourceReadWhileTheLoopRuns(chunks, asyncio.get_running_loop(), LOOP_TURN_LIMIT_S)
        await predict_file(
            settings, overrides, source, "npy", output, Progress(150, 0, io.StringIO())
        )
        return source

    source = asyncio.run(run())
    output.close()

    assert source.read_in
    assert "MainThread" not in source.read_in
    records = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [record["row"] for record in records] == list(range(150))
    assert all(len(record["prediction"]) == 10 for record in records)


@pytest.mark.parametrize(
    "predictions",
    [
        [[0.1, -2.5e-7, 3.0], [1e300, 0.0, -0.0]],
        [np.float32(0.1), np.arange(3, dtype=np.float32), np.eye(2)],
        [{"label": 'a "quoted"\nlabel', "score": 0.5}, "é \u2028", None, True, 7],
        [[{"row": 1, "prediction": [2]}], []],
    ],
)
def test_lines_in_bulk_are_the_records_serialized_one_by_one(predictions: list[Any]) -> None:
    model, version = 'a "model"', "dae3cd981a36"

    lines = answer_lines(41, model, version, predictions)

    options = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
    assert lines == [
        orjson.dumps(
            {"row": row, "model": model, "version": version, "prediction": prediction},
            option=options,
        )
        for row, prediction in enumerate(predictions, start=41)
    ]


#: Pieces of lines: numbers, brackets, braces, quotes, blanks; lines of them are mostly not
#: JSON, which is the point: the check must hold on any bytes.
_PIECES = st.sampled_from(
    [b"[", b"]", b"{", b"}", b'"', b"0.5", b",", b" ", b"\r", b"\n", b"7", b"[[0.25, 1]]", b""]
)


def _counted(line: bytes) -> bool:
    """The check written out: a bracket or brace, no quote, each kind as often closed as
    opened."""
    return (
        any(bracket in line for bracket in (b"[", b"]", b"{", b"}"))
        and b'"' not in line
        and line.count(b"[") == line.count(b"]")
        and line.count(b"{") == line.count(b"}")
    )


@given(st.lists(st.lists(_PIECES, max_size=10).map(b"".join), min_size=1, max_size=20))
def test_a_line_read_from_its_skeleton_is_checked_as_its_counts_say(lines: list[bytes]) -> None:
    """Lines proved one value by their brackets (skeletons remembered from line to line)."""
    for line in lines:
        assert _balanced_without_strings(line) == _counted(line), line


def test_lines_without_brackets_or_left_open_are_left_to_json() -> None:
    row = orjson.dumps(np.full((8, 8), 0.5).tolist()) + b"\n"
    assert _balanced_without_strings(row)
    assert not _balanced_without_strings(b"[[0.5,\n")  # a list left open
    assert not _balanced_without_strings(b'["a"]\n')
    assert not _balanced_without_strings(b"\n")  # blank: orjson refuses it
    assert not _balanced_without_strings(b"5\n")  # a bare number: orjson reads it
