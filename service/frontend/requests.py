"""One request path from every entry point to the engine.

``/predict`` (``predict.py``), V2 REST (``oip/rest.py``) and gRPC (``oip/grpc_server.py``)
each parse their own bodies into the model's named tensors; from there they share this module:
the request's ``Deadline`` (computed once, from ``request_timeout_ms`` or the shorter limit
the client set), and a ``HeldRequest`` that counts the request in ``frontend.holding`` while
it is held, builds the engine's ``InferenceRequest`` (priority, the front end's load; the
engine computes the batch group and token cost from the arrays) and waits for the engine
inside the request's spans, cancelling the wait when an HTTP client leaves. A new entry point
parses its request and calls these; a new request field is set here.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import NamedTuple

from starlette.types import Message, Receive

from service import tracing
from service.bridge.interface import InferenceRequest, InferenceResult, ModelInfo
from service.config import Settings
from service.errors import DeadlineExceededError
from service.frontend import request_spans
from service.frontend.response_cache import ResponseCache
from service.frontend.state import FrontendState
from service.tensors import NamedArrays
from service.types import Priority

#: Where the deadline of a request that set no shorter one comes from.
SERVER_TIMEOUT = "request_timeout_ms"


class ClientDisconnectedError(Exception):
    """The client went away before its answer; there is nobody to answer."""


class Deadline(NamedTuple):
    """When a request is answered 504 if it has no answer yet, and which limit set it (a
    tuple: built for every request, it costs less than a frozen dataclass)."""

    at_s: float
    """``time.monotonic()`` (system-wide, so an engine process reads it alike)."""
    timeout_ms: float
    """The limit that applies, counted from the request's arrival."""
    source: str
    """What set it: ``request_timeout_ms``, or the client's own shorter limit."""

    @classmethod
    def start(cls, settings: Settings, now_s: float | None = None) -> Deadline:
        """``request_timeout_ms`` from now (``now_s``, ``time.monotonic()``)."""
        now_s = time.monotonic() if now_s is None else now_s
        timeout_ms = settings.request_timeout_ms
        return cls(now_s + timeout_ms / 1000.0, timeout_ms, SERVER_TIMEOUT)

    def sooner(self, timeout_s: float | None, source: str, now_s: float | None = None) -> Deadline:
        """This deadline, or ``timeout_s`` from now when that ends sooner (``source`` names
        the client's limit); None leaves it unchanged."""
        if timeout_s is None:
            return self
        now_s = time.monotonic() if now_s is None else now_s
        if now_s + timeout_s >= self.at_s:
            return self
        return Deadline(now_s + timeout_s, timeout_s * 1000.0, source)

    def exceeded(self, error: DeadlineExceededError) -> DeadlineExceededError:
        """The engine's 504 for this request, naming the limit that applied (the engine knows
        only ``request_timeout_ms``); why it could not be answered in time is kept."""
        _, _, why = error.message.partition(" ms: ")
        message = self._not_answered()
        return DeadlineExceededError(f"{message}: {why}" if why else message, headers=error.headers)

    def check(self, what: str) -> None:
        """504 now, naming the limit that applied, when the deadline passed while ``what``."""
        if time.monotonic() >= self.at_s:
            raise DeadlineExceededError(f"{self._not_answered()}: it passed while {what}")

    def _not_answered(self) -> str:
        # A client's limit may be microseconds (a V2 ``timeout``): say so, not "0 ms".
        limit = (
            f"{self.timeout_ms * 1000:.0f} µs"
            if self.timeout_ms < 1
            else f"{self.timeout_ms:.0f} ms"
        )
        return f"the request was not answered within {limit} ({self.source})"


class HeldRequest:
    """A request from its body read to its answer: counted in ``frontend.holding`` (how many
    batch-mates the adaptive policy may wait for) for as long as the ``with`` block lasts."""

    __slots__ = ("deadline", "frontend", "request_id")

    def __init__(self, frontend: FrontendState, deadline: Deadline, request_id: str) -> None:
        self.frontend = frontend
        self.deadline = deadline
        self.request_id = request_id

    def __enter__(self) -> HeldRequest:
        self.frontend.holding += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.frontend.holding -= 1

    async def infer(
        self,
        model: ModelInfo,
        instances: NamedArrays,
        priority: Priority,
        receive: Receive | None = None,
    ) -> InferenceResult:
        """``instances``, validated against ``model``, computed by an engine. ``receive``: an
        HTTP request's, to stop waiting (``ClientDisconnectedError``) if its client leaves."""
        manifest = model.manifest
        request = InferenceRequest(
            model=manifest.name,
            version=manifest.version,
            instances=instances,
            priority=priority,
            deadline_s=self.deadline.at_s,
            request_id=self.request_id,
            frontend_load=self.frontend.holding,
        )
        try:
            if self.frontend.response_cache is not None:  # off, this check is all it costs
                return await self._cached(self.frontend.response_cache, request, receive)
            if receive is None:
                return await request_spans.infer(self.frontend, request)
            with DisconnectWatcher(receive):
                if tracing.current is None:  # the engine awaited directly: a coroutine fewer
                    return await self.frontend.engine.infer(request)
                return await request_spans.infer(self.frontend, request)
        except DeadlineExceededError as error:
            # 0 for one refused early, as unable to finish in time
            overrun_s = max(0.0, time.monotonic() - self.deadline.at_s)
            self.frontend.metrics.deadline_overrun.observe(overrun_s)
            raise self.deadline.exceeded(error) from None

    async def _cached(
        self, cache: ResponseCache, request: InferenceRequest, receive: Receive | None
    ) -> InferenceResult:
        """``request``'s answer from ``cache``, or from the engine through it."""
        compute = partial(request_spans.infer, self.frontend, request)
        # loaded: the primary or a version beside it (a traffic split)
        loaded = self.frontend.engine.status().find_version(request.model, request.version)
        version = None if loaded is None else loaded.manifest.version
        if receive is None:
            return await cache.answer(request, compute, version)
        with DisconnectWatcher(receive):  # a waiter for an identical request leaves too
            return await cache.answer(request, compute, version)


class DisconnectWatcher:
    """While the caller waits for its batch, cancels the wait as soon as the client leaves.

    The cancellation withdraws the request from the engine at once: it stops counting as
    queued work (in the queue's depth and in the wait that admission estimates for every later
    request) and is never computed; it surfaces as ``ClientDisconnectedError``. Without it the
    server would learn of the disconnect only when it wrote the answer. The watch starts with
    the wait: one started later let clients that send and leave at once hold the queue until
    it started, and the requests of the clients who stayed were refused 429.
    """

    __slots__ = ("_caller", "_receive", "_watch", "disconnected")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._watch: asyncio.Future[Message] | None = None
        self.disconnected = False

    def __enter__(self) -> DisconnectWatcher:
        self._caller = asyncio.current_task()
        self._watch = asyncio.ensure_future(self._receive())
        self._watch.add_done_callback(self._on_message)
        return self

    def _on_message(self, watch: asyncio.Future[Message]) -> None:
        if watch.cancelled() or watch.exception() is not None:
            return
        if watch.result()["type"] == "http.disconnect" and self._caller is not None:
            self.disconnected = True
            self._caller.cancel()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: object
    ) -> None:
        if self._watch is not None:
            self._watch.remove_done_callback(self._on_message)
            self._watch.cancel()
        if self.disconnected and kind is asyncio.CancelledError and self._caller is not None:
            self._caller.uncancel()
            raise ClientDisconnectedError from None
