"""Fakes for the batcher tests, named by what they do; no torch.

A payload is a plain list of int rows (lists support ``len`` and slicing, all the batcher
needs). Every fake doubles each row, so each caller's expected output is known exactly.
The fakes run in the batcher's one executor thread; the ones that block wait on a
``threading.Event`` that the test sets from the event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import uvicorn
from asgi_lifespan import LifespanManager
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp

from service.bridge.interface import InferenceRequest, InferenceResult
from service.config import BatchPolicy
from service.engine.batcher import (
    BatchFunction,
    DispatchPolicy,
    DynamicBatcher,
    Ticket,
    dispatch_policy,
)
from service.errors import DeviceOutOfMemoryError, InferenceError
from service.frontend.handlers.base import Handler, HandlerRequest
from service.metrics import EngineMetrics
from service.server.predicting.sources import Chunk
from service.tensors import NamedArrays

Payload = list[int]


class Batcher(DynamicBatcher[Payload, Payload]):
    """A batcher with ``submit``: queue one request and wait for its outputs, as an
    in-process caller does (``Engine.infer``: ``enqueue``, then ``Ticket.wait``)."""

    async def submit(self, payload: Payload, **request: Any) -> list[Payload]:
        return await self.enqueue(payload, **request).wait()


#: A fake's blocking wait gives up after this long, so a broken test fails instead of hanging.
GATE_TIMEOUT_S = 10.0


def doubled(payload: Payload) -> Payload:
    return [2 * row for row in payload]


class RecordingDoubler:
    """Returns each payload's rows doubled; records every batch it was called with."""

    def __init__(self) -> None:
        self.batches: list[list[Payload]] = []
        self._lock = threading.Lock()

    def __call__(self, payloads: list[Payload]) -> list[Payload]:
        self._record(payloads)
        return [doubled(payload) for payload in payloads]

    def _record(self, payloads: list[Payload]) -> None:
        with self._lock:
            self.batches.append([list(payload) for payload in payloads])

    @property
    def calls(self) -> int:
        return len(self.batches)

    @property
    def batch_rows(self) -> list[int]:
        """Rows per forward call, in call order."""
        return [sum(len(payload) for payload in batch) for batch in self.batches]

    @property
    def computed_rows(self) -> list[int]:
        """Every row that reached the model, in call order."""
        return [row for batch in self.batches for payload in batch for row in payload]


class GatedModel(RecordingDoubler):
    """A busy device: each call records its batch, signals ``started``, then blocks until
    ``release()``. Once released it stays open, so later batches run at once."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self._gate = threading.Event()
        self._finished_calls = 0

    def __call__(self, payloads: list[Payload]) -> list[Payload]:
        self._record(payloads)
        self.started.set()
        if not self._gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError("GatedModel was never released")
        with self._lock:
            self._finished_calls += 1
        return [doubled(payload) for payload in payloads]

    async def wait_started(self) -> None:
        """Wait, without blocking the event loop, until the first batch is inside the model."""
        if not await asyncio.to_thread(self.started.wait, GATE_TIMEOUT_S):
            raise AssertionError("no batch reached the model")

    def release(self) -> None:
        self._gate.set()

    @property
    def released(self) -> bool:
        return self._gate.is_set()

    @property
    def finished_calls(self) -> int:
        with self._lock:
            return self._finished_calls


class PoisonModel(RecordingDoubler):
    """Raises ``error`` (``ValueError`` unless given) for any batch holding a row equal to
    ``poison``; doubles otherwise."""

    def __init__(self, poison: int, error: type[Exception] = ValueError) -> None:
        super().__init__()
        self.poison = poison
        self.error = error

    def __call__(self, payloads: list[Payload]) -> list[Payload]:
        self._record(payloads)
        if any(self.poison in payload for payload in payloads):
            raise self.error(f"the model cannot handle row {self.poison}")
        return [doubled(payload) for payload in payloads]


class PoisonAnsweringModel(RecordingDoubler):
    """Answers a payload holding ``poison`` with an exception as its output (a row the model
    fails on alone, as a runner reports non-finite outputs), and doubles the others."""

    def __init__(self, poison: int) -> None:
        super().__init__()
        self.poison = poison

    def __call__(self, payloads: list[Payload]) -> list[Payload | Exception]:  # type: ignore[override]
        self._record(payloads)
        return [
            InferenceError(f"row {self.poison} gave no finite output")
            if self.poison in payload
            else doubled(payload)
            for payload in payloads
        ]


class OutOfMemoryAbove(RecordingDoubler):
    """A device with room for ``max_rows`` rows: a larger batch raises
    ``DeviceOutOfMemoryError`` (and is recorded); the test may change ``max_rows``."""

    def __init__(self, max_rows: int) -> None:
        super().__init__()
        self.max_rows = max_rows

    def __call__(self, payloads: list[Payload]) -> list[Payload]:
        self._record(payloads)
        if sum(len(payload) for payload in payloads) > self.max_rows:
            raise DeviceOutOfMemoryError("CUDA out of memory (fake)")
        return [doubled(payload) for payload in payloads]


class MiscountingModel(RecordingDoubler):
    """Returns one output too few: a broken model the batcher must not trust."""

    def __call__(self, payloads: list[Payload]) -> list[Payload]:
        return super().__call__(payloads)[:-1]


class ManualExecutor(Executor):
    """A device the test finishes by hand: ``submit`` only records the call, and
    ``finish_next()`` runs the oldest one (on the calling thread) and completes its future.
    Lets a test order the device's completion exactly against other events on the loop."""

    def __init__(self) -> None:
        self._calls: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._calls.append((future, fn, args))
        return future

    @property
    def pending(self) -> int:
        return len(self._calls)

    def finish_next(self) -> None:
        future, fn, args = self._calls.popleft()
        try:
            result = fn(*args)
        except Exception as error:  # the device failed: its caller gets the error
            future.set_exception(error)
        else:
            future.set_result(result)

    async def finish_until(self, done: Callable[[], bool], timeout_s: float = 5.0) -> None:
        """Finish calls one by one, as they come, until ``done()``."""
        async with asyncio.timeout(timeout_s):
            while not done():
                await wait_until(lambda: self.pending > 0 or done(), timeout_s)
                if self.pending:
                    self.finish_next()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        while self._calls:
            self._calls.popleft()[0].cancel()


class CountingThreadExecutor(ThreadPoolExecutor):
    """A one-thread device that counts the calls submitted to it, so that a test can wait
    until a batch has been handed to it (and queued behind other work) rather than sleep."""

    def __init__(self, thread_name_prefix: str = "counting-device") -> None:
        super().__init__(max_workers=1, thread_name_prefix=thread_name_prefix)
        self.submitted = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


class SteppedClock:
    """The batcher's clock (``batcher.clock.Clock``) for tests: real time plus an offset the
    test moves on with ``advance``, which also fires at once the timers that came due, so a
    test can say how long requests have waited (or how long ago the device ran out of
    memory) without sleeping. Counts how often the batcher reads it. ``freeze`` stops it, for
    tests of what happens exactly at a limit."""

    def __init__(self) -> None:
        self.offset_s = 0.0
        self.reads = 0
        self._frozen_at_s: float | None = None
        self._timers: list[_SteppedTimer] = []

    def now(self) -> float:
        self.reads += 1
        now_s = time.monotonic() if self._frozen_at_s is None else self._frozen_at_s
        return now_s + self.offset_s

    monotonic = now

    def freeze(self, at_s: float = 1000.0) -> None:
        """Read ``at_s`` from now on (plus what ``advance`` adds): a round number, so that the
        sums and differences of the durations a test sets are exact."""
        self._frozen_at_s = at_s
        self.offset_s = 0.0

    def advance(self, seconds: float) -> None:
        """Move on ``seconds``; the timers due by then run on the loop's next turn."""
        self.offset_s += seconds
        now_s = self.now()
        due = [timer for timer in self._timers if timer.when_s <= now_s]
        for timer in due:
            timer.fire_soon()

    def call_at(self, when_s: float, callback: Callable[[], None]) -> _SteppedTimer:
        timer = _SteppedTimer(self, when_s, callback)
        self._timers.append(timer)
        return timer

    @property
    def armed(self) -> list[float]:
        """When each timer not fired nor cancelled yet is due, in the order they were set."""
        return [timer.when_s for timer in self._timers]


class _SteppedTimer:
    """A timer of ``SteppedClock``: fires in real time (unless frozen), or when the test
    advances the clock past it, whichever comes first; once."""

    def __init__(self, clock: SteppedClock, when_s: float, callback: Callable[[], None]) -> None:
        self._clock = clock
        self.when_s = when_s
        self._callback = callback
        self._done = False
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._real: asyncio.TimerHandle | None = None
        if clock._frozen_at_s is None:
            self._real = loop.call_later(max(0.0, when_s - clock.now()), self._fire)

    def fire_soon(self) -> None:
        self._loop.call_soon(self._fire)

    def _fire(self) -> None:
        if not self._done:
            self.cancel()
            self._callback()

    def cancel(self) -> None:
        self._done = True
        if self._real is not None:
            self._real.cancel()
        if self in self._clock._timers:
            self._clock._timers.remove(self)


#: What a fake's forward takes as the warm-up would have measured it: the fakes answer at
#: once, unless a test holds them (which the batcher must not take for their usual speed).
MEASURED_FORWARD_S = 0.001


class RecordingSink:
    """A front end as the batcher sees it: records each delivery (the tickets one batch, a
    deadline or a cancel finished for it)."""

    def __init__(self) -> None:
        self.deliveries: list[list[Ticket[Any]]] = []

    def deliver(self, tickets: Sequence[Ticket[Any]]) -> None:
        self.deliveries.append(list(tickets))

    @property
    def tickets(self) -> list[Ticket[Any]]:
        return [ticket for delivery in self.deliveries for ticket in delivery]


class BatcherFactory:
    """Builds started batchers, each on its own one-thread executor unless given one; ``aclose``
    releases every gated fake, drains every batcher (finishing the calls a ``ManualExecutor``
    still holds) and shuts the executors down.

    Unless ``measured=False``, each batcher knows (as a model's warm-up tells it) that batches
    of group ``"g"`` take ``MEASURED_FORWARD_S`` at every size up to ``max_batch_size``."""

    def __init__(self, clock: SteppedClock | None = None) -> None:
        self.clock = clock
        self._built: list[tuple[Batcher, Executor, Callable[..., object]]] = []

    def __call__(
        self,
        run_batch: BatchFunction[Payload, Payload],
        *,
        metrics: EngineMetrics | None = None,
        executor: Executor | None = None,
        max_batch_size: int = 4,
        max_wait_ms: float = 50,
        max_queue_size: int = 64,
        request_timeout_ms: float = 5_000,
        measured: bool = True,
        policy: BatchPolicy | DispatchPolicy = "adaptive",
        expected_requests: Callable[[], int] = lambda: 0,
        **options: Any,
    ) -> Batcher:
        if executor is None:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-device")
        batcher = Batcher(
            run_batch,
            policy=dispatch_policy(
                policy,
                max_wait_ms,
                expected_requests=expected_requests,
                instances=options.get("instances", 1),
            )
            if isinstance(policy, str)
            else policy,
            executor=executor,
            metrics=(metrics if metrics is not None else EngineMetrics()).for_model("test", "v1"),
            max_batch_size=max_batch_size,
            max_queue_size=max_queue_size,
            request_timeout_ms=request_timeout_ms,
            **({"clock": self.clock} | options),
        )
        if measured:
            for rows in range(1, max_batch_size + 1):
                for _ in range(3):
                    batcher.times.record("g", rows, MEASURED_FORWARD_S)
        batcher.start()
        self._built.append((batcher, executor, run_batch))
        return batcher

    async def aclose(self) -> None:
        for _, _, run_batch in self._built:
            if isinstance(run_batch, GatedModel):
                run_batch.release()
        for batcher, executor, _ in self._built:
            async with asyncio.timeout(GATE_TIMEOUT_S):
                draining = asyncio.ensure_future(batcher.drain())
                if isinstance(executor, ManualExecutor):  # finish what the test left running
                    await executor.finish_until(draining.done, GATE_TIMEOUT_S)
                await draining
            executor.shutdown(wait=True)


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Yield to the event loop until ``condition()`` holds; fail after ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.001)


@asynccontextmanager
async def uvicorn_port(config: uvicorn.Config) -> AsyncIterator[int]:
    """The port of a uvicorn server run on ``config`` (its port 0: one the system chooses)
    until the block ends, then stopped."""
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


def sample_total(
    registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None
) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (every model's
    series, unless ``labels`` names one); 0 when there is none."""
    wanted = (labels or {}).items()
    return float(
        sum(
            sample.value
            for family in registry.collect()
            for sample in family.samples
            if sample.name == name and wanted <= sample.labels.items()
        )
    )


def dropped(metrics: EngineMetrics, reason: str) -> float:
    """``batchserve_dropped_requests_total{reason=...}``, 0 when never incremented."""
    return sample_total(metrics.registry, "batchserve_dropped_requests_total", {"reason": reason})


def sample(metrics: EngineMetrics, name: str) -> float:
    """A sample's value summed over the models, 0 when absent."""
    return sample_total(metrics.registry, name)


def flatten(outputs: Sequence[Payload]) -> Payload:
    return [row for output in outputs for row in output]


def predict_scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """An ASGI HTTP scope for ``POST /predict``, for tests that drive the app message by
    message (a body that never finishes, a client that disconnects)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/predict",
        "raw_path": b"/predict",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }


class HandlerGate:
    """Holds a test's bundled handler inside its preprocessing (in a handler thread) until the
    test opens it; ``entered`` says a request got there. Thread events: handlers run in
    threads, not on the event loop."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def reset(self) -> None:
        self.entered.clear()
        self.opened.clear()


#: The gate of ``tests/test_hostile_clients.py``'s bundled ``WaitsAtTheGate`` handler.
HANDLER_GATE = HandlerGate()


class HandlerParsingItsOwnBodies(Handler):
    """A handler that reads a media type of its own (neither texts, images nor tensors): what
    ``tune`` cannot generate bodies for."""

    media_types: ClassVar[frozenset[str]] = frozenset({"application/cbor"})

    def preprocess(self, request: HandlerRequest) -> NamedArrays:
        raise NotImplementedError("a test's handler: never sent a request")


class AnswersValuesJsonCannotHold(Handler):
    """The base handler's tensors in, and a Python set out for each instance: a handler
    whose answers cannot be written as JSON."""

    def postprocess(self, outputs: NamedArrays, request: HandlerRequest) -> list[Any]:
        return [{index} for index in range(len(outputs))]


class EchoingGenerator:
    """An engine serving ``models`` whose generation repeats each prompt's ids, cycling,
    ``tokens_per_event`` at a time: a request's answer is known from its prompt alone. A
    sequence ends with ``length`` at ``max_tokens`` (16 when None), or with ``stop`` at an id
    of ``stop_token_ids`` (included). Each token's log-probability is -1.0 and its top
    ``logprobs`` are itself at -1.0. ``refusal``: raised by every request before its first
    item. ``gate``: when set, each sequence waits on it after its first event (a stream that
    stays open); ``first_gate``: likewise before its first event (a sequence still queued).
    ``failing_after``: events after which a sequence fails (``error``). Keeps
    each request, and counts the sequences closed before they finished (cancelled)."""

    def __init__(self, *models: Any, tokens_per_event: int = 1) -> None:
        from service.bridge.interface import EngineStatus

        self._status = EngineStatus(phase="ready", models=tuple(models))
        self.tokens_per_event = tokens_per_event
        self.requests: list[Any] = []
        self.refusal: Exception | None = None
        self.gate: asyncio.Event | None = None
        self.failing_after: int | None = None
        self.first_gate: asyncio.Event | None = None
        self.cancelled = 0
        self.finished = 0

    def status(self) -> Any:
        return self._status

    def engines(self) -> list[Any]:
        return [self._status]

    def refusal_before_body(
        self, model: str, version: str, priority: str, deadline_s: float | None
    ) -> None:
        return None

    async def infer(self, request: Any) -> Any:
        raise NotImplementedError

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        from service.bridge.interface import GeneratedTokens

        self.requests.append(request)
        if self.refusal is not None:
            raise self.refusal
        limit = 16 if request.max_tokens is None else request.max_tokens
        prompt = request.prompt_ids
        produced = 0
        events = 0
        done = False
        try:
            if self.first_gate is not None:
                await self.first_gate.wait()
            while not done:
                if events == self.failing_after:
                    done = True
                    yield GeneratedTokens((), finish_reason="error", version=request.version)
                    return
                events += 1
                ids: list[int] = []
                reason = None
                while len(ids) < self.tokens_per_event:
                    token = prompt[produced % len(prompt)]
                    ids.append(token)
                    produced += 1
                    if token in request.stop_token_ids:
                        reason = "stop"
                    elif produced >= limit:
                        reason = "length"
                    if reason is not None:
                        break
                done = reason is not None
                logprobs = None if request.logprobs is None else tuple(-1.0 for _ in ids)
                top = (
                    None
                    if request.logprobs is None
                    else tuple(((token, -1.0),) * request.logprobs for token in ids)
                )
                yield GeneratedTokens(tuple(ids), logprobs, top, reason, request.version)
                if self.gate is not None:
                    await self.gate.wait()
                else:
                    await asyncio.sleep(0)
            self.finished += 1
        finally:
            if not done:
                self.cancelled += 1

    async def switch(self, name: str, version: str) -> Any:
        raise NotImplementedError

    async def rollback(self, name: str | None = None) -> Any:
        raise NotImplementedError

    async def unload(self, name: str) -> Any:
        raise NotImplementedError


class SourceReadWhileTheLoopRuns:
    """A ``batchserve predict`` source whose every chunk is read only once the event loop has
    run a callback handed to it at that moment: read on the loop itself, it fails (the loop
    cannot run the callback while it waits) after ``timeout_s``."""

    def __init__(
        self, chunks: Sequence[Chunk], loop: asyncio.AbstractEventLoop, timeout_s: float
    ) -> None:
        self._chunks = chunks
        self.loop = loop
        self.timeout_s = timeout_s
        self.rows = sum(len(chunk) for chunk in chunks)
        self.read_in: set[str] = set()
        """The names of the threads that read the chunks."""

    def chunks(self, size: int, skip: int = 0) -> Iterator[Chunk]:
        for chunk in self._chunks:
            self.read_in.add(threading.current_thread().name)
            ran = threading.Event()
            self.loop.call_soon_threadsafe(ran.set)
            if not ran.wait(self.timeout_s):
                raise AssertionError(
                    f"the event loop ran nothing for {self.timeout_s} s while a chunk was read"
                )
            yield chunk


class GatedDoublingEngine:
    """An engine's ``infer`` for the response cache's tests: answers each request's inputs
    doubled, named ``version``, once ``gate`` is set (open from the start unless told), and
    counts its calls; ``failures`` of the first calls raise ``InferenceError``."""

    def __init__(self, version: str, *, open_gate: bool = True, failures: int = 0) -> None:
        self.version = version
        self.calls = 0
        self.failures = failures
        self.gate = asyncio.Event()
        if open_gate:
            self.gate.set()

    def computing(self, request: InferenceRequest) -> Callable[[], Awaitable[InferenceResult]]:
        """What the cache calls to have ``request`` computed."""

        async def compute() -> InferenceResult:
            self.calls += 1
            call = self.calls
            await self.gate.wait()
            if call <= self.failures:
                raise InferenceError("the forward failed")
            doubled = {name: array * 2 for name, array in request.instances.arrays.items()}
            return InferenceResult(NamedArrays(doubled), self.version)

        return compute


def lifespan(app: ASGIApp) -> LifespanManager:
    """``app``'s startup and shutdown, given the time a busy machine needs: asgi-lifespan's 5 s
    default failed tests whose engine loaded and warmed up while other work shared the cores."""
    return LifespanManager(app, startup_timeout=120, shutdown_timeout=120)
