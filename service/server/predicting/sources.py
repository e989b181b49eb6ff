"""The input files of ``batchserve predict``, read a chunk of rows at a time.

A file is never held whole: JSON Lines and text files are read line by line, ``.npy`` arrays
and ``.npz`` members row block by row block from their streams (an ``.npz`` member inflated as
it is read), Parquet files a record batch at a time. Each format's rows are what one
``/predict`` instance would be (the formats: ``docs/getting-started.md``). What makes every
row unusable (a wrong dtype, shape or set of names) is an ``InputFileError``
before anything runs; what makes one row unusable is that row's error, as ``/predict`` would
answer it.
"""

from __future__ import annotations

import itertools
import math
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import orjson

from service.errors import BadRequestError, ServiceError
from service.frontend.bodies import npy_header
from service.manifest import Manifest, TensorSpec
from service.types import Array

#: The formats ``--input-format`` names, and the suffixes that name them.
FORMATS_BY_SUFFIX = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".txt": "txt",
    ".npy": "npy",
    ".npz": "npz",
    ".parquet": "parquet",
}
INPUT_FORMATS = ("jsonl", "txt", "npy", "npz", "parquet")
#: Bytes read at once while counting lines or skipping rows.
_BLOCK_BYTES = 1 << 20


class InputFileError(Exception):
    """The input file cannot give rows for this model at all; nothing was run."""


@dataclass(frozen=True, slots=True)
class JsonRows:
    """Rows ``start`` onwards, each the bytes of what should be one JSON instance, or the
    error that row already has (a text line that is not UTF-8, a value JSON cannot hold)."""

    start: int
    values: Sequence[bytes | ServiceError]

    def __len__(self) -> int:
        return len(self.values)


@dataclass(frozen=True, slots=True)
class ArrayRows:
    """Rows ``start`` onwards of each named input, as the model's dtype."""

    start: int
    arrays: dict[str, Array]

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))


Chunk = JsonRows | ArrayRows


class Source(Protocol):
    """An input file open for reading."""

    rows: int
    """How many rows the file holds."""

    def chunks(self, size: int, skip: int = 0) -> Iterator[Chunk]:
        """The rows after the first ``skip``, ``size`` at a time (the last chunk may be
        shorter), in file order."""
        ...


def input_format(path: Path, named: str | None) -> str:
    """``named`` (``--input-format``), else the format ``path``'s suffix names."""
    if named is not None:
        return named
    found = FORMATS_BY_SUFFIX.get(path.suffix.lower())
    if found is None:
        suffixes = ", ".join(FORMATS_BY_SUFFIX)
        raise InputFileError(
            f"{path}: cannot tell the format from the suffix {path.suffix!r} (known: "
            f"{suffixes}); name it with --input-format {{{','.join(INPUT_FORMATS)}}}"
        )
    return found


def open_source(path: Path, format: str, manifest: Manifest, resources: ExitStack) -> Source:
    """``path`` open as rows for ``manifest``'s inputs, closed with ``resources``."""
    if not path.is_file():
        raise InputFileError(f"{path}: no such file")
    if format == "jsonl":
        return LineSource(path, text=False)
    if format == "txt":
        return LineSource(path, text=True)
    if format == "npy":
        if len(manifest.inputs) > 1:
            names = [spec.name for spec in manifest.inputs]
            raise InputFileError(
                f"{path}: {manifest.label} takes {len(names)} inputs {names}: give an .npz "
                "file with an array per name, or JSON Lines"
            )
        stream = resources.enter_context(path.open("rb"))
        return ArraySource({manifest.input.name: NpyStream(stream, str(path))}, manifest, path)
    if format == "npz":
        return _npz_source(path, manifest, resources)
    if format == "parquet":
        source = ParquetSource(path, manifest)
        resources.callback(source.file.close)
        return source
    raise InputFileError(f"unknown input format {format!r}; one of {', '.join(INPUT_FORMATS)}")


class LineSource:
    """JSON Lines (each line one JSON instance) or text (each line one text)."""

    def __init__(self, path: Path, *, text: bool) -> None:
        self.path = path
        self.text = text
        self.rows = _count_lines(path)

    def chunks(self, size: int, skip: int = 0) -> Iterator[Chunk]:
        with self.path.open("rb") as lines:
            for _ in itertools.islice(lines, skip):
                pass
            start = skip
            # A JSON line is kept with its newline: JSON reads it as the space it is.
            while block := list(itertools.islice(lines, size)):
                if self.text:
                    yield JsonRows(
                        start, [self._text(line, start + at) for at, line in enumerate(block)]
                    )
                else:
                    yield JsonRows(start, block)
                start += len(block)

    @staticmethod
    def _text(line: bytes, row: int) -> bytes | ServiceError:
        """The line's text, without its line ending, as a JSON string."""
        try:
            text = line.removesuffix(b"\n").removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError as error:
            return BadRequestError(
                f"the line is not valid UTF-8: byte {error.start} is "
                f"{line[error.start : error.start + 1]!r}"
            )
        if row == 0:
            text = text.removeprefix("\ufeff")  # a byte order mark is no part of the text
        return orjson.dumps(text)


def _count_lines(path: Path) -> int:
    """Lines in ``path``, the last one counted whether or not a newline ends it."""
    count = 0
    last = b"\n"
    with path.open("rb") as file:
        while block := file.read(_BLOCK_BYTES):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


class NpyStream:
    """One ``.npy`` array read a block of rows at a time from a stream (a file, or an
    ``.npz`` member inflated as it is read). Never unpickles: object arrays are refused."""

    def __init__(self, stream: IO[bytes], where: str) -> None:
        self.stream = stream
        self.where = where
        try:
            shape, fortran_order, dtype = npy_header(stream)
        except ValueError as error:
            raise InputFileError(f"{where}: not a .npy array: {error}") from None
        if dtype.hasobject:
            raise InputFileError(f"{where}: holds Python objects, which are never unpickled")
        if not shape:
            raise InputFileError(f"{where}: a 0-d array holds no rows")
        if fortran_order and len(shape) > 1:
            raise InputFileError(
                f"{where}: is in Fortran order, whose rows cannot be read one block at a time; "
                "save np.ascontiguousarray(array)"
            )
        self.shape: tuple[int, ...] = shape
        self.dtype: np.dtype[Any] = dtype
        self.row_bytes = math.prod(shape[1:]) * dtype.itemsize

    @property
    def rows(self) -> int:
        return self.shape[0]

    def skip(self, rows: int) -> None:
        left = rows * self.row_bytes
        while left > 0:
            skipped = len(self.stream.read(min(left, _BLOCK_BYTES)))
            if skipped == 0:
                raise InputFileError(f"{self.where}: the data ends before its {rows} rows")
            left -= skipped

    def read(self, rows: int) -> Array:
        """The next ``rows`` rows, writable, in native byte order."""
        data = self.stream.read(rows * self.row_bytes)
        if len(data) != rows * self.row_bytes:
            raise InputFileError(f"{self.where}: the data ends before the {self.rows} rows")
        array = np.frombuffer(data, self.dtype).reshape((rows, *self.shape[1:]))
        return array.astype(self.dtype.newbyteorder("="), copy=True)


class ArraySource:
    """The rows of named ``.npy`` arrays (one per input, of one row count), read together."""

    def __init__(self, arrays: dict[str, NpyStream], manifest: Manifest, path: Path) -> None:
        specs = {spec.name: spec for spec in manifest.inputs}
        for name, array in arrays.items():
            _check_rows_fit(specs[name], array)
        counts = {name: array.rows for name, array in arrays.items()}
        if len(set(counts.values())) > 1:
            raise InputFileError(f"{path}: every input needs one row per instance, got {counts}")
        self.arrays = arrays
        self.rows = next(iter(counts.values()))

    def chunks(self, size: int, skip: int = 0) -> Iterator[Chunk]:
        for array in self.arrays.values():
            array.skip(skip)
        for start in range(skip, self.rows, size):
            rows = min(size, self.rows - start)
            yield ArrayRows(start, {name: array.read(rows) for name, array in self.arrays.items()})


def _check_rows_fit(spec: TensorSpec, array: NpyStream) -> None:
    """The array's dtype and row shape are the input's (as ``/predict`` checks a ``.npy``)."""
    if array.dtype.newbyteorder("=") != spec.numpy_dtype:
        raise InputFileError(
            f"{array.where}: input {spec.name!r} must be {spec.numpy_dtype.name}, got "
            f"{array.dtype.name}"
        )
    row_shape = array.shape[1:]
    expected = spec.instance_shape
    if len(row_shape) != len(expected) or any(
        size not in (-1, got) for size, got in zip(expected, row_shape, strict=True)
    ):
        wanted = ", ".join("L" if size == -1 else str(size) for size in expected)
        raise InputFileError(
            f"{array.where}: the rows of input {spec.name!r} must be shaped ({wanted}) (L: "
            f"any length), got {row_shape} (rows along axis 0)"
        )


def _npz_source(path: Path, manifest: Manifest, resources: ExitStack) -> ArraySource:
    try:
        archive = resources.enter_context(zipfile.ZipFile(path))
    except zipfile.BadZipFile as error:
        raise InputFileError(f"{path}: not an .npz archive: {error}") from None
    names = [spec.name for spec in manifest.inputs]
    required = {spec.name for spec in manifest.inputs if spec.default_value is None}
    members = {info.filename.removesuffix(".npy"): info for info in archive.infolist()}
    if not required <= members.keys() <= set(names):
        raise InputFileError(
            f"{path}: the .npz archive must hold exactly the arrays {names} (those with a "
            f"default value may be left out), got {sorted(members)}"
        )
    arrays = {}
    for name in (name for name in names if name in members):
        stream = resources.enter_context(archive.open(members[name]))
        arrays[name] = NpyStream(stream, f"{path}:{members[name].filename}")
    return ArraySource(arrays, manifest, path)


class ParquetSource:
    """Rows of a Parquet file, each an instance object of the columns named after inputs,
    or the value of its one column."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        try:
            import pyarrow.parquet as parquet
        except ModuleNotFoundError:
            raise InputFileError(
                f"{path}: reading Parquet needs pyarrow: pip install 'batchserve[batch]'"
            ) from None
        try:
            self.file = parquet.ParquetFile(path)
        except Exception as error:  # pyarrow's own errors (ArrowInvalid...) for a bad file
            raise InputFileError(f"{path}: not a Parquet file: {error}") from None
        columns: list[str] = list(self.file.schema_arrow.names)
        inputs = [spec.name for spec in manifest.inputs if spec.name in columns]
        required = [spec.name for spec in manifest.inputs if spec.default_value is None]
        if inputs and not set(required) <= set(inputs):
            raise InputFileError(
                f"{path}: has columns {inputs} but not {sorted(set(required) - set(inputs))}: "
                f"give a column per input {required}"
            )
        if inputs:
            self.columns, self.by_name = inputs, True
        elif len(columns) == 1:
            self.columns, self.by_name = columns, False
        else:
            names = [spec.name for spec in manifest.inputs]
            raise InputFileError(
                f"{path}: give a column per input {names}, or a file of one column (each "
                f"value an instance); got columns {columns}"
            )
        self.rows = int(self.file.metadata.num_rows)

    def chunks(self, size: int, skip: int = 0) -> Iterator[Chunk]:
        start = 0
        for batch in self.file.iter_batches(batch_size=size, columns=self.columns):
            if start + batch.num_rows <= skip:
                start += batch.num_rows
                continue
            records: list[dict[str, Any]] = batch.to_pylist()[max(0, skip - start) :]
            start = max(start, skip)
            values = [self._value(record) for record in records]
            for offset in range(0, len(values), size):
                yield JsonRows(start + offset, values[offset : offset + size])
            start += len(values)

    def _value(self, record: dict[str, Any]) -> bytes | ServiceError:
        instance = record if self.by_name else record[self.columns[0]]
        try:
            return orjson.dumps(instance)
        except TypeError as error:  # bytes, decimals: no JSON instance holds them
            return BadRequestError(f"the row cannot be an instance as JSON: {error}")
