"""A file's rows through an engine process, answered in order.

The model is loaded and run as ``batchserve serve --workers N`` runs it, by an engine process
per device (``engine_process``); this process is their front end without HTTP. Chunks of
several batches of rows are prepared (``rows``) where ``/predict`` prepares a body: by the
feeder thread (``feeder``), or in the handler threads for a handler of the model's own.
On the event loop, each is queued as one request through ``HeldRequest.infer``, the one path
of every entry point (``ChunkAnswers``). A window of chunks is in flight at once: enough to
keep the device's batches full while the next chunks are read and prepared, few enough that
the queue never refuses them and the memory held is a few chunks, whatever the file's size.
The feeder writes the answers as each oldest chunk completes, so the output is in input
order. Rows have no deadline; a model that hangs is caught by ``stall_timeout_s`` in its
engine, which exits; an engine that ends stops the run, its answers written so far kept,
and no row is written as failed for it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from service.bridge.interface import InferenceResult, ModelInfo
from service.config import Settings
from service.errors import EngineUnavailableError, ServiceError
from service.frontend.preprocessing import handler_thread_count
from service.frontend.requests import Deadline, HeldRequest
from service.frontend.state import FrontendState
from service.processes import EXIT_STALLED
from service.server.predicting.engine_process import (
    STOP_GRACE_S,
    EngineExitedError,
    engine_processes,
)
from service.server.predicting.feeder import Answered, Computed, Feeder, Refused
from service.server.predicting.output_file import OutputFile
from service.server.predicting.progress import Progress
from service.server.predicting.rows import RowPreparer, RowsRequest
from service.server.predicting.sources import Chunk, InputFileError, Source

T = TypeVar("T")

#: Batches of rows per chunk (a request), within ``max_instances_per_request``: the engine's
#: event loop reads, admits and answers a request once for all its batches, and its queue holds
#: full batches enough to run several in one hand-off (``max_run_ms``).
BATCHES_PER_CHUNK = 16
#: Chunks in flight per device instance: one running, and the next ones queued, so that a batch
#: is ready when one ends even while the feeder waits for a core to submit the next chunk.
CHUNKS_PER_INSTANCE = 4
#: A row's deadline: none (``HeldRequest`` names this source should one ever be reported).
NO_DEADLINE = Deadline(math.inf, math.inf, "batchserve predict")


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
    """Rows per chunk (``BATCHES_PER_CHUNK`` batches), and chunks in flight: those the device
    instances run and queue, and (``prepared_in_threads``: a handler's own preprocess) one
    being prepared in each handler thread; never more than the queue holds if every row of
    them runs alone."""
    rows = min(settings.max_batch_size * BATCHES_PER_CHUNK, settings.max_instances_per_request)
    rows = min(rows, settings.max_queue_size)
    window = CHUNKS_PER_INSTANCE * settings.device_instances
    if prepared_in_threads:
        window += handler_thread_count(settings.handler_threads)
    return rows, max(1, min(window, settings.max_queue_size // rows))


async def predict_file(
    settings: Settings,
    overrides: Mapping[str, object],
    source: Source,
    format: str,
    output: OutputFile,
    progress: Progress,
) -> Summary:
    """Answer the rows of ``source`` not in ``output`` yet, appending their lines;
    ``overrides``: the command's settings, for the engine processes."""
    async with engine_processes(settings, overrides) as engines:
        frontend = engines.frontend
        model = frontend.serving_model(settings.model_name)
        preparer = RowPreparer(frontend.handler_for(model), model.manifest)
        problem = preparer.unreadable(format)
        if problem is not None:
            raise InputFileError(problem)
        answering = ChunkAnswers(frontend, model, preparer)
        rows, window = chunk_sizes(settings, prepared_in_threads=not preparer.tensors_only)
        loop = asyncio.get_running_loop()
        feeder = Feeder(loop, answering, preparer, rows=rows, window=window)
        started_s = time.monotonic()
        progress.start()
        with ThreadPoolExecutor(1, thread_name_prefix="batchserve-feeder") as thread:
            feeding = loop.run_in_executor(thread, feeder.run, source, output, progress)
            try:
                ending: list[asyncio.Future[Any]] = [feeding, *engines.exits]
                await asyncio.wait(ending, return_when=asyncio.FIRST_COMPLETED)
                if not feeding.done():  # an engine ended first
                    raise _engine_ended(engines.exit_status(), model, settings)
                try:
                    feeding.result()
                except EngineUnavailableError:  # its connection was lost: it ended, or hangs
                    status = await engines.exit_status_within(STOP_GRACE_S)
                    raise _engine_ended(status, model, settings) from None
            finally:
                if not feeding.done():
                    feeder.stop()
                    await asyncio.wait([feeding])
                await answering.settle()
        return Summary(
            model.manifest.label,
            output.tally.rows - output.resumed_rows,
            time.monotonic() - started_s,
        )


def _engine_ended(status: int | None, model: ModelInfo, settings: Settings) -> Exception:
    """The error to end the run with once the engine was lost (``status``: its exit status,
    None while it still runs)."""
    if status == EXIT_STALLED:
        return ModelStalledError(
            f"a batch of {model.manifest.label} ran longer than stall_timeout_s "
            f"({settings.stall_timeout_s:g} s): the model hangs"
        )
    return EngineExitedError(status)


class ChunkAnswers:
    """The event loop's side: a chunk's rows computed as one request, or each alone when
    that fails, through ``HeldRequest.infer`` as ``/predict``'s requests."""

    def __init__(self, frontend: FrontendState, model: ModelInfo, preparer: RowPreparer) -> None:
        self.frontend = frontend
        self.model = model
        self.preparer = preparer
        self._running: set[asyncio.Task[Any]] = set()

    async def computed(self, chunk: Chunk, prepared: RowsRequest | ServiceError | None) -> Computed:
        with self._tracked():
            if prepared is None:  # a handler of the model's own: in the handler threads
                try:
                    prepared = await self._in_thread(self.preparer.together, chunk)
                except ServiceError as error:
                    prepared = error
            if isinstance(prepared, RowsRequest):
                try:
                    return Answered(prepared, await self._infer(prepared))
                except EngineUnavailableError:
                    raise  # no row's fault: the run ends
                except ServiceError:
                    pass  # some row, or the chunk as a whole, failed: each row is run alone
            return await self._alone(chunk)

    async def alone(self, chunk: Chunk) -> list[Answered | Refused]:
        with self._tracked():
            return await self._alone(chunk)

    async def settle(self) -> None:
        """Cancel what is still computing (a run stopped, or failed) and wait for it."""
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)

    async def _alone(self, chunk: Chunk) -> list[Answered | Refused]:
        prepared = await self._in_thread(self.preparer.alone, chunk)
        rows = enumerate(prepared, start=chunk.start)
        return list(await asyncio.gather(*(self._one(row, one) for row, one in rows)))

    async def _one(self, row: int, prepared: RowsRequest | ServiceError) -> Answered | Refused:
        if isinstance(prepared, ServiceError):
            return Refused(row, prepared)
        try:
            return Answered(prepared, await self._infer(prepared))
        except EngineUnavailableError:
            raise
        except ServiceError as error:
            return Refused(row, error)

    async def _infer(self, request: RowsRequest) -> InferenceResult:
        with HeldRequest(self.frontend, NO_DEADLINE, f"row-{request.start}") as held:
            return await held.infer(self.model, request.instances, "normal")

    @contextmanager
    def _tracked(self) -> Iterator[None]:
        """The current task counted as running until it ends, for ``settle``."""
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            yield
        finally:
            self._running.discard(task)

    async def _in_thread(self, step: Callable[..., T], *args: object) -> T:
        """``step`` in the handler threads: the event loop stays free to start batches."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.frontend.handler_pool, step, *args)
