"""The generation loop of one generative version: its continuous batch stepped on the device
thread, a device turn per step, and each request's tokens handed to its stream.

The batch (``generation.ContinuousBatch``) is not thread-safe, so the event loop never touches
it: submissions and cancellations go into a queue that the device thread drains at the start of
each step (cancellations and submissions in the order they came, so a slot freed by a cancel is
free for the request after it). A step runs the batch's prefill, then its decode; the prefill's
events are sent to the event loop as soon as they exist and the decode's with the step's
result, so that a new request's first token is handed out while the running streams' decode
runs, not after it. Each stream's token goes to its ``TokenSink``: an in-process caller's
``bridge.streams.TokenQueue``, or a front end's bridge connection, which gathers the tokens of
one delivery for all its streams into one frame.

What needs no device is answered at once on the event loop, before anything is queued: 422
for sampling settings out of range, token ids outside the vocabulary or a prompt that never
fits, 429 with ``Retry-After`` when every KV-cache slot is taken and the waiting room is full.
A request has two deadlines: its first token's (``request_timeout_ms``, or the client's
sooner limit) and its whole stream's (``generation_timeout_s``). When one passes, the stream
ends with 504 (``DeadlineExceededError``, sent as the stream's error) and its sequence is
cancelled, its slot free at the next step. Waiting requests join the batch by
priority (``X-Priority: high`` first), in arrival order within one.

A loop serves one version: when its model switches to another version, the old loop takes no
new request and finishes its streams (``drain``), so a stream is produced by one version from
its first token to its last.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from service.bridge.interface import GeneratedTokens, GenerateRequest
from service.engine.batcher.run import StallWatch
from service.engine.device_turns import ModelTurns
from service.engine.generation.sampling import SamplingParams
from service.engine.generation.sequences import GenerationRequest, TokenEvent
from service.engine.generation_span import StreamSpan
from service.errors import (
    DeadlineExceededError,
    InferenceError,
    NotReadyError,
    QueueFullError,
    ServiceError,
)
from service.metrics import EngineMetrics

if TYPE_CHECKING:  # it imports transformers, which only a generative version needs
    from service.engine.generation.cohorts import CohortBatch
    from service.engine.generation.continuous_batch import ContinuousBatch

logger = logging.getLogger(__name__)


class TokenSink(Protocol):
    """Where one stream's tokens go, on the event loop."""

    def tokens(self, item: GeneratedTokens) -> None:
        """The stream's next token; the last has a ``finish_reason``."""
        ...

    def failed(self, error: ServiceError) -> None:
        """The stream ends with ``error`` (refused, past its deadline, or a failed step)."""
        ...


@dataclass(frozen=True, slots=True)
class _Cancel:
    key: int


@dataclass(slots=True)
class _Stream:
    sink: TokenSink
    arrived_s: float
    prompt_tokens: int
    stream_deadline_s: float
    """When the stream must have ended (``GenerateRequest.stream_deadline_s``)."""
    tokens: int = 0
    last_token_s: float = 0.0
    deadline_timer: asyncio.TimerHandle | None = None
    span: StreamSpan | None = None

    def stop_timer(self) -> None:
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()
            self.deadline_timer = None

    def ended(self, outcome: str) -> None:
        """The stream is over: no timer left, its span (if traced) ended with ``outcome``."""
        self.stop_timer()
        if self.span is not None:
            self.span.end(self.tokens, outcome)
            self.span = None


@dataclass(frozen=True, slots=True)
class _StepResult:
    events: list[TokenEvent]
    refused: list[tuple[Hashable, ServiceError]]
    running: int
    waiting: int


def deadline_message(tokens: int) -> str:
    """What a stream whose deadline passed is told, once it had ``tokens`` tokens."""
    if not tokens:
        return "the first token did not come by the request's deadline"
    return (
        f"the request's deadline passed after {tokens} generated tokens: the stream was "
        "ended there (raise generation_timeout_s, or ask for fewer tokens)"
    )


class GenerationLoop:
    """Serves one generative version's batch (a causal LM's ``ContinuousBatch``, an
    encoder-decoder's ``CohortBatch``): ``submit``, ``cancel``, ``drain``."""

    def __init__(
        self,
        batch: ContinuousBatch | CohortBatch,
        *,
        model: str,
        version: str,
        executor: Executor,
        turns: ModelTurns,
        metrics: EngineMetrics,
        stall: StallWatch,
    ) -> None:
        """``stall``: marks the loop stalled when a step outlives ``stall_timeout_s``, as a
        batcher's batches do."""
        self.batch = batch
        self.model = model
        self.version = version
        self._executor = executor
        self._turns = turns
        self._stall = stall
        self._inbox: deque[GenerationRequest | _Cancel] = deque()
        """Filled on the event loop, drained on the device thread (deque is thread-safe for
        append and popleft)."""
        self._streams: dict[int, _Stream] = {}
        self._keys = itertools.count(1)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._ttft = metrics.time_to_first_token.labels(model)
        self._itl = metrics.inter_token_latency.labels(model)
        self._tokens = metrics.generated_tokens.labels(model)
        self._gauges = (
            (metrics.running_sequences, (model, version)),
            (metrics.waiting_sequences, (model, version)),
            (metrics.kv_cache_slots, (model, version, "used")),
            (metrics.kv_cache_slots, (model, version, "total")),
        )
        self._running, self._waiting, self._slots_used, self._slots_total = (
            gauge.labels(*labels) for gauge, labels in self._gauges
        )

    @property
    def stalled(self) -> bool:
        """A step has run longer than ``stall_timeout_s``: the model may be hung."""
        return self._stall.stalled

    @property
    def streams(self) -> int:
        """Streams not finished (cancelled ones leave at once)."""
        return len(self._streams)

    def start(self) -> None:
        self._slots_total.set(self.batch.slots)
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"batchserve-generate-{self.model}"
        )

    def submit(self, request: GenerateRequest, sink: TokenSink) -> int:
        """Queue ``request`` to join the batch at its next step; its key for ``cancel``.
        Raises the refusals that need no device (see the module's docstring)."""
        if self._closing or self._stall.stalled:
            raise NotReadyError(
                f"{self.model}@{self.version} is not generating here now (stalled, or no "
                "longer served); retry when /readyz answers 200"
            )
        sampling = SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k or 0,
            seed=request.seed,
            logprobs=request.logprobs is not None,
            top_logprobs=request.logprobs or 0,
        )
        key = next(self._keys)
        generation = GenerationRequest(
            request_id=key,
            prompt_ids=tuple(request.prompt_ids),
            max_tokens=request.max_tokens,
            sampling=sampling,
            stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            priority=request.priority,
        )
        self.batch.check(generation)
        capacity = self.batch.slots + self.batch.max_waiting_sequences
        if len(self._streams) >= capacity:
            raise QueueFullError(
                f"{self.model}'s KV cache holds {self.batch.slots} sequences and "
                f"{self.batch.max_waiting_sequences} more may wait "
                f"(max_running_sequences, kv_cache_mb, max_waiting_sequences): all are "
                "taken; retry later"
            )
        now_s = time.monotonic()
        if request.deadline_s <= now_s:
            raise DeadlineExceededError("the request's deadline passed before it was queued")
        stream = _Stream(
            sink,
            arrived_s=now_s,
            prompt_tokens=len(generation.prompt_ids),
            stream_deadline_s=request.stream_deadline_s,
        )
        stream.span = StreamSpan.start(
            request.traceparent, self.model, self.version, stream.prompt_tokens
        )
        first_deadline_s = min(request.deadline_s, request.stream_deadline_s)
        if first_deadline_s != float("inf"):
            stream.deadline_timer = asyncio.get_running_loop().call_later(
                first_deadline_s - now_s, self._expire, key
            )
        self._streams[key] = stream
        self._idle.clear()
        self._inbox.append(generation)
        self._wake.set()
        return key

    def cancel(self, key: int) -> None:
        """Stop the stream ``key``: its sink hears nothing more, its slot is free at the
        next step. Nothing happens for a stream that has finished."""
        stream = self._streams.pop(key, None)
        if stream is None:
            return
        stream.ended("cancelled")
        self._inbox.append(_Cancel(key))
        self._wake.set()
        self._check_idle()

    async def drain(self) -> None:
        """Take no new request, let every stream finish, then stop."""
        self._closing = True
        await self._idle.wait()
        self._stall.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for gauge, labels in self._gauges:
            # Zeroed before removed: with several processes the value lives on in this
            # process's metrics file, which remove() does not touch.
            gauge.labels(*labels).set(0)
            gauge.remove(*labels)

    def _expire(self, key: int) -> None:
        """The request's deadline passed: its stream ends with 504 and its sequence leaves
        the batch at the next step."""
        stream = self._streams.get(key)
        if stream is None:
            return
        now_s = time.monotonic()
        if stream.tokens and stream.stream_deadline_s > now_s:  # its first token came in time
            if stream.stream_deadline_s != float("inf"):
                stream.deadline_timer = asyncio.get_running_loop().call_later(
                    stream.stream_deadline_s - now_s, self._expire, key
                )
            else:
                stream.deadline_timer = None
            return
        error = DeadlineExceededError(deadline_message(stream.tokens))
        stream.ended(error.code)  # before cancel() would end it as cancelled
        self.cancel(key)
        stream.sink.failed(error)

    def _check_idle(self) -> None:
        if not self._streams:
            self._idle.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._streams or self._inbox):
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                async with self._turns.turn():
                    step = self._stall.started(time.monotonic())
                    try:
                        result = await loop.run_in_executor(
                            self._executor, self._step, loop.call_soon_threadsafe
                        )
                    finally:
                        self._stall.finished(step)
                self._deliver(result)
            except Exception:
                # Left running, the streams would wait forever; the batch keeps its sequences
                # until the cancels queued here reach it.
                logger.exception("generation_step_failed", extra={"model": self.model})
                self._fail_all()

    def _step(
        self, on_loop: Callable[[Callable[[_StepResult], None], _StepResult], object]
    ) -> _StepResult:
        """One iteration, on the device thread: the queued cancels and submissions, the
        batch's prefill, whose events go to the event loop at once (``on_loop``: the loop's
        ``call_soon_threadsafe``, so they are delivered before this step's result, while the
        decode runs), then its decode. Cancels that come meanwhile wait for the next step."""
        refused = self._take_inbox()
        batch = self.batch
        if batch.prefill_due:
            first = batch.prefill()
            if first or refused:
                on_loop(self._deliver, self._result(first, refused))
                refused = []
        return self._result(batch.decode(), refused)

    def _take_inbox(self) -> list[tuple[Hashable, ServiceError]]:
        """The queued cancels and submissions into the batch, in the order they came; the
        submissions it refused."""
        batch = self.batch
        refused: list[tuple[Hashable, ServiceError]] = []
        inbox = self._inbox
        while inbox:
            item = inbox.popleft()
            if isinstance(item, _Cancel):
                batch.cancel(item.key)
                continue
            try:
                batch.submit(item)
            except ServiceError as error:
                refused.append((item.request_id, error))
        return refused

    def _result(
        self, events: list[TokenEvent], refused: list[tuple[Hashable, ServiceError]]
    ) -> _StepResult:
        return _StepResult(events, refused, self.batch.running, self.batch.waiting)

    def _deliver(self, result: _StepResult) -> None:
        """A step's events to their streams (a stream cancelled meanwhile hears nothing)."""
        streams = self._streams
        for request_id, error in result.refused:
            stream = streams.pop(cast(int, request_id), None)
            if stream is not None:
                stream.ended(error.code)
                stream.sink.failed(error)
        now_s = time.monotonic()
        for event in result.events:
            key = cast(int, event.request_id)
            stream = streams.get(key)
            if stream is None:
                continue
            if event.token_id is not None:
                self._tokens.inc()
            if stream.last_token_s:
                self._itl.observe(now_s - stream.last_token_s)
            else:
                self._ttft.observe(now_s - stream.arrived_s)
                if stream.span is not None:
                    stream.span.first_token()
            stream.last_token_s = now_s
            stream.tokens += event.token_id is not None
            if event.finish_reason is not None:
                del streams[key]
                stream.ended(event.finish_reason)
                logger.debug(
                    "generation_finished",
                    extra={
                        "model": self.model,
                        "version": self.version,
                        "prompt_tokens": stream.prompt_tokens,
                        "completion_tokens": stream.tokens,
                        "finish_reason": event.finish_reason,
                    },
                )
            if event.finish_reason == "error":
                logger.warning(
                    "generation_sequence_failed",
                    extra={"model": self.model, "reason": "non-finite logits"},
                )
            stream.sink.tokens(self._item(event))
        self._running.set(result.running)
        self._waiting.set(result.waiting)
        self._slots_used.set(result.running)
        self._check_idle()

    def _item(self, event: TokenEvent) -> GeneratedTokens:
        if event.token_id is None:
            return GeneratedTokens((), finish_reason=event.finish_reason, version=self.version)
        return GeneratedTokens(
            (event.token_id,),
            None if event.logprob is None else (event.logprob,),
            None if event.top_logprobs is None else (event.top_logprobs,),
            event.finish_reason,
            self.version,
        )

    def _fail_all(self) -> None:
        """A step raised: every stream ends with 500 and its sequence is cancelled."""
        streams, self._streams = self._streams, {}
        for key, stream in streams.items():
            error = InferenceError("the generation step failed in the engine")
            stream.ended(error.code)
            self._inbox.append(_Cancel(key))
            stream.sink.failed(error)
        self._check_idle()
