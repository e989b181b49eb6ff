"""A file's rows through the engine in this process, answered in order.

The model is loaded as ``batchserve serve`` loads it in one process (``single.loaded``).
Chunks of ``max_batch_size`` rows are prepared (``rows``) where ``/predict`` prepares a body
and queued as one request each through ``HeldRequest.infer``, the one path of every entry
point. A window of chunks is in flight at once: enough to keep the device's batches full while
the next chunks are read and prepared, few enough that the queue never refuses them and the
memory held is a few chunks, whatever the file's size. Answers are written as each oldest
chunk completes, so the output is in input order. Rows have no deadline; a model that hangs
is caught by ``stall_timeout_s``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import orjson

from service.bridge.interface import InferenceResult, ModelInfo
from service.config import Settings
from service.errors import HandlerError, ServiceError
from service.frontend.preprocessing import handler_thread_count
from service.frontend.requests import Deadline, HeldRequest
from service.frontend.state import FrontendState
from service.server.predicting.output_file import OutputFile, answer_line, error_line
from service.server.predicting.progress import Progress
from service.server.predicting.rows import RowPreparer, RowsRequest
from service.server.predicting.sources import Chunk, InputFileError, Source
from service.server.single import loaded

T = TypeVar("T")

#: Chunks in flight per device instance: one running, and the next queued to start as it ends
#: (more served fewer rows/s, measured: see docs/bench/batching.md).
CHUNKS_PER_INSTANCE = 2
#: A row's deadline: none (``HeldRequest`` names this source should one ever be reported).
NO_DEADLINE = Deadline(math.inf, math.inf, "batchserve predict")

#: A row's line of output, and its error's fields when it failed.
Line = tuple[bytes, dict[str, object] | None]


class ModelStalledError(Exception):
    """A batch ran longer than ``stall_timeout_s``: the device thread is stuck in the model."""


@dataclass(frozen=True)
class Summary:
    model: str
    """``name@version``."""
    rows_written: int
    """Rows answered by this run (the output's other rows were kept from before)."""
    seconds: float
    """From the first chunk read to the last line written (the model's load excluded)."""


def chunk_sizes(settings: Settings, prepared_in_threads: bool) -> tuple[int, int]:
    """Rows per chunk (a batch), and chunks in flight: those the device instances run and
    queue, and (``prepared_in_threads``: a handler's own preprocess) one being prepared in
    each handler thread; never more than the queue holds if every row of them runs alone."""
    rows = min(settings.max_batch_size, settings.max_instances_per_request)
    rows = min(rows, settings.max_queue_size)
    window = CHUNKS_PER_INSTANCE * settings.device_instances
    if prepared_in_threads:
        window += handler_thread_count(settings.handler_threads)
    return rows, max(1, min(window, settings.max_queue_size // rows))


async def predict_file(
    settings: Settings, source: Source, format: str, output: OutputFile, progress: Progress
) -> Summary:
    """Answer the rows of ``source`` not in ``output`` yet, appending their lines."""
    main = asyncio.current_task()
    stalled: list[bool] = []

    def on_stall() -> None:
        stalled.append(True)
        if main is not None:
            main.cancel()

    async with loaded(settings, on_stall) as app:
        frontend: FrontendState = app.state.frontend
        model = frontend.serving_model(settings.model_name)
        preparer = RowPreparer(frontend.handler_for(model), model.manifest)
        problem = preparer.unreadable(format)
        if problem is not None:
            raise InputFileError(problem)
        answering = ChunkAnswers(frontend, model, preparer)
        rows, window = chunk_sizes(settings, prepared_in_threads=not preparer.tensors_only)
        started_s = time.monotonic()
        progress.start()
        in_flight: deque[asyncio.Task[list[Line]]] = deque()
        try:
            for chunk in source.chunks(rows, skip=output.tally.rows):
                in_flight.append(asyncio.create_task(answering.lines(chunk)))
                if len(in_flight) >= window:
                    _write(output, await in_flight.popleft(), progress)
            while in_flight:
                _write(output, await in_flight.popleft(), progress)
        except asyncio.CancelledError:
            if stalled:
                raise ModelStalledError(
                    f"a batch of {model.manifest.label} ran longer than stall_timeout_s "
                    f"({settings.stall_timeout_s:g} s): the model hangs"
                ) from None
            raise
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
        return Summary(
            model.manifest.label,
            output.tally.rows - output.resumed_rows,
            time.monotonic() - started_s,
        )


def _write(output: OutputFile, lines: list[Line], progress: Progress) -> None:
    output.write([line for line, _ in lines])
    for _, error in lines:
        output.tally.count(output.tally.rows, error)
    progress.update(output.tally.rows)


class ChunkAnswers:
    """A chunk's lines of output: its rows as one request, or each alone when that fails."""

    def __init__(self, frontend: FrontendState, model: ModelInfo, preparer: RowPreparer) -> None:
        self.frontend = frontend
        self.model = model
        self.preparer = preparer
        self.name = model.manifest.name

    async def lines(self, chunk: Chunk) -> list[Line]:
        try:
            if self.preparer.cheap_to_prepare(chunk):
                request = self.preparer.together(chunk)
            else:
                request = await self._in_thread(self.preparer.together, chunk)
            return await self._answered(request)
        except ServiceError:
            pass  # some row, or the chunk as a whole, failed: each row is run alone
        prepared = await self._in_thread(self.preparer.alone, chunk)
        rows = enumerate(prepared, start=chunk.start)
        outcomes = await asyncio.gather(*(self._answered_alone(row, one) for row, one in rows))
        return [line for lines in outcomes for line in lines]

    async def _answered_alone(self, row: int, prepared: RowsRequest | ServiceError) -> list[Line]:
        try:
            if isinstance(prepared, ServiceError):
                raise prepared
            return await self._answered(prepared)
        except ServiceError as error:
            version = self.model.manifest.version
            line = error_line(row, self.name, version, error)
            return [(line, {"status": error.status_code, "message": error.message})]

    async def _answered(self, request: RowsRequest) -> list[Line]:
        """The request's rows computed, postprocessed and written as lines."""
        with HeldRequest(self.frontend, NO_DEADLINE, f"row-{request.start}") as held:
            result = await held.infer(self.model, request.instances, "normal")
        # On the event loop, as /predict's answers: a thread hop costs more than a chunk's
        # postprocess (softmax and top-k of a few rows) and lines.
        return self._answer_lines(request, result)

    def _answer_lines(self, request: RowsRequest, result: InferenceResult) -> list[Line]:
        values = self.preparer.answers(request, result)
        try:
            return [
                (answer_line(request.start + offset, self.name, result.version, value), None)
                for offset, value in enumerate(values)
            ]
        except orjson.JSONEncodeError as error:
            raise HandlerError(
                f"the model's handler answered a value JSON cannot hold ({error})"
            ) from None

    async def _in_thread(self, step: Callable[..., T], *args: object) -> T:
        """``step`` in the handler threads: the event loop stays free to start batches."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.frontend.handler_pool, step, *args)
