"""The feeder of ``batchserve predict``: one thread that reads, prepares and writes the rows,
so that the event loop only sends chunks to the engine and takes their answers.

Everything a row costs outside the forward (reading it, parsing and checking it, turning its
answer into a line and writing that line) holds the GIL for a while. On the event loop, that
work would delay sending the next chunk and reading the answers until the loop's current
step ended. Done in this thread, it no longer holds up the loop's steps, and the chunks in
flight keep a batch queued in the engine meanwhile. The rows still go through the engine's
batcher one chunk a request (``run.ChunkAnswers``), so its policy, the handlers and the
version recorded per row stay the path of ``/predict``.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Coroutine
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import orjson

from service.bridge.interface import InferenceResult
from service.errors import HandlerError, ServiceError
from service.server.predicting.output_file import OutputFile, answer_lines, error_line
from service.server.predicting.progress import Progress
from service.server.predicting.rows import RowPreparer, RowsRequest
from service.server.predicting.sources import Chunk, Source

T = TypeVar("T")

#: A row's line of output, and its error's fields when it failed.
Line = tuple[bytes, dict[str, object] | None]


@dataclass(frozen=True, slots=True)
class Answered:
    """Rows computed as one request."""

    request: RowsRequest
    result: InferenceResult


@dataclass(frozen=True, slots=True)
class Refused:
    """A row run alone, and its error."""

    row: int
    error: ServiceError


#: What the engine gave a chunk: its rows answered together, or each row run alone.
Computed = Answered | list[Answered | Refused]


class ChunkComputing(Protocol):
    """The event loop's side of the run (``run.ChunkAnswers``)."""

    def computed(
        self, chunk: Chunk, prepared: RowsRequest | ServiceError | None
    ) -> Coroutine[Any, Any, Computed]:
        """The chunk's rows computed together, or each alone when that fails; ``prepared``:
        the rows as one request prepared by the feeder, the error preparing them gave, or
        None for the event loop's side to prepare them."""
        ...

    def alone(self, chunk: Chunk) -> Coroutine[Any, Any, list[Answered | Refused]]:
        """Each row of the chunk prepared and computed as a request of its own."""
        ...


class FeederStoppedError(Exception):
    """The run was stopped (a stalled model, an interrupt) while the feeder waited."""


class Feeder:
    """Reads ``source`` a chunk at a time, hands each to the event loop to compute, and
    appends the answers of each oldest chunk to ``output`` in input order; ``window`` chunks
    in flight at most."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        answering: ChunkComputing,
        preparer: RowPreparer,
        *,
        rows: int,
        window: int,
    ) -> None:
        self.loop = loop
        self.answering = answering
        self.preparer = preparer
        self.rows = rows
        self.window = window
        self.name = preparer.manifest.name
        self._lock = threading.Lock()
        self._stopped = False
        self._submitted: set[Future[Any]] = set()

    def run(self, source: Source, output: OutputFile, progress: Progress) -> None:
        """Answer the rows of ``source`` not in ``output`` yet (in this thread)."""
        in_flight: deque[tuple[Chunk, Future[Computed]]] = deque()
        try:
            for chunk in source.chunks(self.rows, skip=output.tally.rows):
                prepared = self._prepared(chunk)
                in_flight.append((chunk, self._submit(self.answering.computed(chunk, prepared))))
                if len(in_flight) >= self.window:
                    self._write(output, progress, *in_flight.popleft())
            while in_flight:
                self._write(output, progress, *in_flight.popleft())
        except FeederStoppedError:
            pass
        finally:
            for _, future in in_flight:
                future.cancel()

    def stop(self) -> None:
        """Stop the run (from any thread): what the feeder waits on is cancelled, and it
        submits nothing more."""
        with self._lock:
            self._stopped = True
            for future in list(self._submitted):
                future.cancel()

    def _prepared(self, chunk: Chunk) -> RowsRequest | ServiceError | None:
        """The chunk's rows as one request, prepared here when no handler of the model's own
        prepares them (then in the handler threads: ``None``)."""
        if not self.preparer.tensors_only:
            return None
        try:
            return self.preparer.together(chunk)
        except ServiceError as error:
            return error

    def _write(
        self,
        output: OutputFile,
        progress: Progress,
        chunk: Chunk,
        computing: Future[Computed],
    ) -> None:
        lines = self._lines(chunk, self._wait(computing))
        output.write([line for line, _ in lines])
        for _, error in lines:
            output.tally.count(output.tally.rows, error)
        progress.update(output.tally.rows)

    def _lines(self, chunk: Chunk, computed: Computed) -> list[Line]:
        """A line per row of the chunk; when the answers of its rows together cannot be
        written (the handler's postprocess failed), its rows run again one request each."""
        if isinstance(computed, Answered):
            try:
                return self._answer_lines(computed)
            except ServiceError:
                computed = self._wait(self._submit(self.answering.alone(chunk)))
        return [line for one in computed for line in self._row_lines(one)]

    def _row_lines(self, computed: Answered | Refused) -> list[Line]:
        if isinstance(computed, Answered):
            try:
                return self._answer_lines(computed)
            except ServiceError as error:
                return [self._error_line(computed.request.start, error)]
        return [self._error_line(computed.row, computed.error)]

    def _answer_lines(self, answered: Answered) -> list[Line]:
        request, result = answered.request, answered.result
        values = self.preparer.answers(request, result)
        try:
            lines = answer_lines(request.start, self.name, result.version, values)
        except orjson.JSONEncodeError as error:
            raise HandlerError(
                f"the model's handler answered a value JSON cannot hold ({error})"
            ) from None
        return [(line, None) for line in lines]

    def _error_line(self, row: int, error: ServiceError) -> Line:
        line = error_line(row, self.name, self.preparer.manifest.version, error)
        return line, {"status": error.status_code, "message": error.message}

    def _submit(self, work: Coroutine[Any, Any, T]) -> Future[T]:
        """``work`` started on the event loop; ``FeederStoppedError`` once the run is stopped."""
        with self._lock:
            if self._stopped:
                work.close()
                raise FeederStoppedError
            future = asyncio.run_coroutine_threadsafe(work, self.loop)
            self._submitted.add(future)
        future.add_done_callback(self._submitted.discard)
        return future

    def _wait(self, future: Future[T]) -> T:
        try:
            return future.result()
        except CancelledError:
            raise FeederStoppedError from None
