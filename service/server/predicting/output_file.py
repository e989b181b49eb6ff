"""The output of ``batchserve predict``: one JSON line per input row, in input order.

Each line is a record of one row: ``{"row", "model", "version", "prediction"}``, the
prediction being what ``/predict`` answers for that instance alone, or ``{"row", "model",
"version", "error": {"status", "code", "message"}}`` with ``/predict``'s status and message.
Lines are appended whole, a chunk of rows at a time, so a run killed at any instant leaves
complete lines that are all valid, and at most one torn line after them. ``--resume`` keeps
the complete lines, once they are checked to be rows 0, 1, 2... of the same model and version,
drops a torn last line, and appends the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import orjson

from service.errors import ServiceError

_PREDICTION_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
_OPTIONS = _PREDICTION_OPTIONS | orjson.OPT_APPEND_NEWLINE
#: Failed rows named in the summary.
FAILED_ROWS_SHOWN = 5


class OutputFileError(Exception):
    """The output file cannot be written, or resumed, by this run."""


def answer_lines(start: int, model: str, version: str, predictions: list[Any]) -> list[bytes]:
    """The line of each prediction, rows ``start`` onwards: the bytes of ``{"row", "model",
    "version", "prediction"}`` as one ``orjson.dumps`` writes the record, its fixed fields
    serialized once for all the rows."""
    middle = b',"model":%b,"version":%b,"prediction":' % (
        orjson.dumps(model),
        orjson.dumps(version),
    )
    return [
        b'{"row":%d%b%b}\n' % (row, middle, orjson.dumps(prediction, option=_PREDICTION_OPTIONS))
        for row, prediction in enumerate(predictions, start)
    ]


def error_line(row: int, model: str, version: str, error: ServiceError) -> bytes:
    problem = {"status": error.status_code, "code": error.code, "message": error.message}
    return orjson.dumps(
        {"row": row, "model": model, "version": version, "error": problem}, option=_OPTIONS
    )


@dataclass
class Tally:
    """Rows written, and which failed (the first few named)."""

    rows: int = 0
    failed: int = 0
    first_failed: list[tuple[int, str]] = field(default_factory=list)
    """(row, message) of the first ``FAILED_ROWS_SHOWN`` failed rows."""

    def count(self, row: int, error: dict[str, Any] | None) -> None:
        self.rows += 1
        if error is None:
            return
        self.failed += 1
        if len(self.first_failed) < FAILED_ROWS_SHOWN:
            self.first_failed.append((row, f"{error.get('status')} {error.get('message')}"))


class OutputFile:
    """The output file, new or resumed, appended a chunk of lines at a time."""

    def __init__(self, path: Path, *, resume: bool, model: str, version: str) -> None:
        self.path = path
        self.tally = Tally()
        """The rows of the file so far, those kept from before included."""
        if path.exists() and not resume:
            raise OutputFileError(
                f"{path} exists: pass --resume to continue it, or remove it to start again"
            )
        self.created = not path.exists()
        try:
            if not self.created:
                self._keep_written(model, version)
            self._file = path.open("ab")
        except OSError as error:
            raise OutputFileError(f"{path}: {error.strerror}") from None
        self.resumed_rows = self.tally.rows

    def write(self, lines: list[bytes]) -> None:
        """Append ``lines`` (each a whole record ending in a newline) to the file."""
        self._file.write(b"".join(lines))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def discard_if_unused(self) -> None:
        """Remove the file if this run created it and wrote nothing: a run refused after the
        model's load leaves no output that the next run would have to be told to resume."""
        self._file.close()
        if self.created and self.tally.rows == 0:
            self.path.unlink(missing_ok=True)

    def _keep_written(self, model: str, version: str) -> None:
        """Count the complete lines of the file, each checked to be the next row's record
        for ``model`` at ``version``, and cut off a torn last line."""
        kept_bytes = 0
        with self.path.open("r+b") as file:
            for line in file:
                if not line.endswith(b"\n"):
                    break  # torn by a run that was killed: it is written again
                record = self._record(line)
                if (record.get("model"), record.get("version")) != (model, version):
                    raise OutputFileError(
                        f"{self.path} was written by {record.get('model')}@"
                        f"{record.get('version')} (line {self.tally.rows + 1}); this run uses "
                        f"{model}@{version}: resume it with --model {record.get('model')} "
                        f"--version {record.get('version')}, or write to another file"
                    )
                self.tally.count(self.tally.rows, record.get("error"))
                kept_bytes += len(line)
            file.truncate(kept_bytes)

    def _record(self, line: bytes) -> dict[str, Any]:
        row = self.tally.rows
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        if not _is_record(record, row):
            raise OutputFileError(
                f"line {row + 1} of {self.path} is not the record of row {row} that batchserve "
                "predict writes: this file is not an output to resume; write to another file"
            )
        return record


def _is_record(record: object, row: int) -> TypeGuard[dict[str, Any]]:
    """Whether ``record`` is a line this command writes, for ``row``."""
    return (
        isinstance(record, dict)
        and record.get("row") == row
        and isinstance(record.get("model"), str)
        and isinstance(record.get("version"), str)
        and ("prediction" in record) != isinstance(record.get("error"), dict)
    )
