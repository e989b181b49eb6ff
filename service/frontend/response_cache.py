"""Engine answers kept by content, so a repeated input costs no forward (``response_cache_mb``).

Each front end keeps its own cache, of the models named in ``response_cache_models``. A key is
(model, version, the parsed input: each array's name, dtype, shape and bytes), never the body:
two encodings of one input share a key, and two different inputs never do. What is kept is the
engine's answer (its outputs and the version that computed them), not an HTTP body, so every
protocol shapes its own answer from it, with its own parameters (a handler's ``top_k``), as
it does from a fresh answer.

A request is looked up under the version it was validated against, and only while that
version is still served; an answer is kept under the version that computed it (the engine may
run a request on a version it is interchangeable with, and names that one). After a switch or
a rollback, no request is answered from the cache with another version's answer, nor with an
answer of a version no longer served.

Identical requests in flight share one computation: the first asks the engine, the others
wait for its answer. If the first fails or is cancelled (its client left, its own deadline
passed), nothing is kept and each waiter tries once more itself. Generation never comes here
(``EngineClient.generate``): it is not cached.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import numpy as np

from service.bridge.interface import InferenceRequest, InferenceResult
from service.config import Settings
from service.errors import DeadlineExceededError
from service.metrics import FrontendMetrics
from service.tensors import NamedArrays

#: What an entry costs beside its arrays' bytes (the key tuple, the dict slot, the result).
ENTRY_OVERHEAD_BYTES = 512

InputKey = tuple[tuple[str, str, tuple[int, ...], bytes], ...]
"""Each input's name, dtype (``dtype.str``: byte order included), shape and bytes, by name."""


class CacheKey(NamedTuple):
    model: str
    version: str
    inputs: InputKey


def input_key(instances: NamedArrays) -> InputKey | None:
    """The canonical form of a parsed input, or None for one that has none: an array of
    Python objects, whose bytes are addresses, not values."""
    parts: list[tuple[str, str, tuple[int, ...], bytes]] = []
    for name in sorted(instances.names):
        array = instances[name]
        if array.dtype.hasobject:
            return None
        parts.append((name, array.dtype.str, array.shape, np.ascontiguousarray(array).tobytes()))
    return tuple(parts)


def _input_bytes(key: InputKey) -> int:
    return sum(len(data) + len(name) for name, _, _, data in key)


def _kept(result: InferenceResult) -> InferenceResult:
    """A copy of ``result`` to keep: its own memory (a row of a batch's answer would hold the
    whole batch's), read-only, since every later hit shares it, without a trace's batches."""
    arrays = {}
    for name, array in result.outputs.arrays.items():
        copy = np.array(array, copy=True, order="C")
        copy.flags.writeable = False
        arrays[name] = copy
    return InferenceResult(outputs=NamedArrays.of_rows(arrays), version=result.version)


class _Entry(NamedTuple):
    result: InferenceResult
    size_bytes: int


class ResponseCache:
    """An LRU of engine answers bounded in bytes, with identical requests in flight coalesced."""

    def __init__(
        self, capacity_bytes: int, models: frozenset[str] | None, metrics: FrontendMetrics
    ) -> None:
        """``models``: the names whose answers are kept; None for every model."""
        self.capacity_bytes = capacity_bytes
        self.models = models
        self.size_bytes = 0
        self._metrics = metrics
        self._entries: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._in_flight: dict[CacheKey, asyncio.Future[InferenceResult | None]] = {}
        self._model_bytes: dict[str, int] = {}
        self.waiting = 0
        """Requests waiting now for the answer to an identical request in flight."""

    @classmethod
    def from_settings(cls, settings: Settings, metrics: FrontendMetrics) -> ResponseCache | None:
        """The cache ``settings`` ask for, or None when ``response_cache_mb`` is 0."""
        if settings.response_cache_mb == 0:
            return None
        names = settings.response_cache_models
        models = None if "*" in names else frozenset(names)
        return cls(settings.response_cache_mb * 1024 * 1024, models, metrics)

    def __len__(self) -> int:
        return len(self._entries)

    async def answer(
        self,
        request: InferenceRequest,
        compute: Callable[[], Awaitable[InferenceResult]],
        served_version: str | None,
    ) -> InferenceResult:
        """``request``'s answer: kept, being computed for an identical request, or from
        ``compute`` (the engine), kept for the next one. ``served_version``: the request's
        version if it is still loaded (served, or beside the primary in a traffic split), else
        None; a request whose version was switched away goes to the engine alone, which
        refuses it or computes it as it would without a cache."""
        model = request.model
        inputs = None
        if served_version == request.version and (self.models is None or model in self.models):
            inputs = input_key(request.instances)
        if inputs is None:
            return await compute()
        key = CacheKey(model, request.version, inputs)
        for attempt in range(2):
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._metrics.response_cache_hits.labels(model).inc()
                return entry.result
            in_flight = self._in_flight.get(key)
            if in_flight is None:
                return await self._compute(key, compute)
            self.waiting += 1
            try:
                result = await self._wait(in_flight, request.deadline_s)
            finally:
                self.waiting -= 1
            if result is not None:
                self._metrics.response_cache_hits.labels(model).inc()
                return result
            if attempt == 1:  # the first failed, and so did the one tried again: alone
                break
        self._metrics.response_cache_misses.labels(model).inc()
        return await compute()

    async def _compute(
        self, key: CacheKey, compute: Callable[[], Awaitable[InferenceResult]]
    ) -> InferenceResult:
        """``compute``'s answer, kept and handed to the requests that wait for it meanwhile;
        when it fails or is cancelled they are handed None, and nothing is kept."""
        self._count_model(key.model)
        self._metrics.response_cache_misses.labels(key.model).inc()
        future: asyncio.Future[InferenceResult | None] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            result = await compute()
            kept = _kept(result)
        except BaseException:
            future.set_result(None)
            raise
        finally:
            del self._in_flight[key]
        # Kept under the version that computed it, which may not be the one it was validated
        # against: never where a request validated against another version would find it.
        self._keep(key._replace(version=result.version), kept)
        future.set_result(kept)
        return result

    @staticmethod
    async def _wait(
        future: asyncio.Future[InferenceResult | None], deadline_s: float
    ) -> InferenceResult | None:
        """The answer an identical request in flight gets (None if it got none), or 504 when
        this request's own deadline passes first. Shielded: a waiter that leaves does not
        cancel the computation the others wait for."""
        left_s = max(0.0, deadline_s - time.monotonic())
        try:
            return await asyncio.wait_for(asyncio.shield(future), left_s)
        except TimeoutError:
            raise DeadlineExceededError(
                f"the request was not answered within {left_s * 1000:.0f} ms: it passed "
                "while an identical request was computed"
            ) from None

    def _keep(self, key: CacheKey, result: InferenceResult) -> None:
        size = ENTRY_OVERHEAD_BYTES + _input_bytes(key.inputs)
        size += sum(array.nbytes for array in result.outputs.arrays.values())
        if size > self.capacity_bytes:
            return
        previous = self._entries.pop(key, None)
        if previous is not None:
            self._account(key.model, -previous.size_bytes)
        while self.size_bytes + size > self.capacity_bytes:
            evicted_key, evicted = self._entries.popitem(last=False)
            self._account(evicted_key.model, -evicted.size_bytes)
            self._metrics.response_cache_evictions.labels(evicted_key.model).inc()
        self._entries[key] = _Entry(result, size)
        self._account(key.model, size)

    def _account(self, model: str, change_bytes: int) -> None:
        self.size_bytes += change_bytes
        self._model_bytes[model] = held = self._model_bytes.get(model, 0) + change_bytes
        self._metrics.response_cache_bytes.labels(model).set(held)

    def _count_model(self, model: str) -> None:
        """Every series of ``model`` exported from its first request on, at 0 until counted."""
        if model not in self._model_bytes:
            self._model_bytes[model] = 0
            metrics = self._metrics
            for counter in (
                metrics.response_cache_hits,
                metrics.response_cache_misses,
                metrics.response_cache_evictions,
            ):
                counter.labels(model)
            metrics.response_cache_bytes.labels(model).set(0)
