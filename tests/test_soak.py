"""``loadtests/soak.py``: its reference check, and a short soak of the real server."""

from __future__ import annotations

import csv
from pathlib import Path

import orjson
import pytest

from loadtests import soak


@pytest.fixture(scope="module")
def reference() -> soak.Reference:
    return soak.Reference(pool=4, seed=0)


def test_the_reference_accepts_its_own_rows_and_catches_a_wrong_one(
    reference: soak.Reference,
) -> None:
    row = reference.expected[1].tolist()

    def answer(predictions: object, version: str = reference.version) -> bytes:
        return orjson.dumps({"model": "digits", "version": version, "predictions": predictions})

    assert reference.check(1, answer([row])) == soak.OK
    assert reference.check(5, answer([row])) == soak.OK  # the pool repeats
    assert reference.check(2, answer([row])) == soak.MISMATCH  # another input's row
    assert reference.check(1, answer([[value + 1e-3 for value in row]])) == soak.MISMATCH
    assert reference.check(1, answer([row, row])) == soak.MISMATCH
    assert reference.check(1, answer([row], version="000000000000")) == soak.MISMATCH


@pytest.mark.slow
def test_ten_seconds_of_steady_load_with_no_error_and_no_mismatch(tmp_path: Path) -> None:
    result = soak.run(["--rate", "20", "--duration-s", "10", "--window-s", "5"])
    report = soak.report_markdown(result)
    print(report)
    assert result.errors == {}, report
    assert result.mismatches == 0, report
    assert len(result.outcomes) == 200
    assert result.kinds[soak.OK] == 200
    assert result.passed
    windows = result.windows()
    assert [len(window.outcomes) for window in windows] == [100, 100]
    assert all(window.rss_bytes for window in windows), result.rss
    assert "| 200 of 200 | 200 | 200 | 0 | 0 |" in report

    path = tmp_path / "soak.csv"
    soak.write_csv(result, path)
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["requests"] for row in rows] == ["100", "100"]
    assert all(float(row["p99_ms"]) > 0 for row in rows)
