"""The response cache (``service/frontend/response_cache.py``): keys made of the parsed input
and the version, answers kept under the version that computed them, bounded in bytes, and
identical requests in flight computed once."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from service.bridge.interface import InferenceRequest, InferenceResult
from service.config import SettingsError, load_settings
from service.errors import DeadlineExceededError, InferenceError
from service.frontend.response_cache import ENTRY_OVERHEAD_BYTES, ResponseCache, input_key
from service.metrics import FrontendMetrics
from service.tensors import NamedArrays
from tests.fixtures import GatedDoublingEngine, sample_total, wait_until

V1 = "aaaaaaaaaaaa"
V2 = "bbbbbbbbbbbb"
IDENTICAL = 64


def cache_of(capacity_bytes: int = 1 << 20, models: frozenset[str] | None = None) -> ResponseCache:
    return ResponseCache(capacity_bytes, models, FrontendMetrics(CollectorRegistry()))


def counted(cache: ResponseCache, what: str, model: str = "m") -> float:
    registry = cache._metrics.registry
    return sample_total(registry, f"batchserve_response_cache_{what}", {"model": model})


def request_of(
    values: list[float], version: str = V1, model: str = "m", deadline_s: float | None = None
) -> InferenceRequest:
    return InferenceRequest(
        model=model,
        version=version,
        instances=NamedArrays.of(x=np.asarray([values], dtype=np.float32)),
        priority="normal",
        deadline_s=time.monotonic() + 30.0 if deadline_s is None else deadline_s,
        request_id="r",
    )


async def answer(
    cache: ResponseCache,
    engine: GatedDoublingEngine,
    request: InferenceRequest,
    served_version: str | None = None,
) -> InferenceResult:
    """``request`` answered through ``cache``, served the version it was validated against
    unless ``served_version`` says another is served now."""
    served = request.version if served_version is None else served_version
    return await cache.answer(request, engine.computing(request), served)


def test_the_key_is_the_parsed_arrays_never_equal_for_different_inputs() -> None:
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    same = np.frombuffer(values.tobytes(), dtype=np.float32).reshape(2, 3)
    assert input_key(NamedArrays.of(x=values)) == input_key(NamedArrays.of(x=same))
    assert input_key(NamedArrays.of(x=values)) == input_key(NamedArrays.of(x=values.T.copy().T))
    different = [
        NamedArrays.of(x=values.astype(np.float64)),  # the same numbers, another dtype
        NamedArrays.of(x=values.reshape(3, 2)),  # the same bytes, another shape
        NamedArrays.of(y=values),  # another input name
        NamedArrays.of(x=values.astype(">f4")),  # the same numbers, another byte order
        NamedArrays.of(x=np.where(values == 0, np.float32(-0.0), values)),  # -0.0 is not 0.0
    ]
    keys = {input_key(NamedArrays.of(x=values)), *(input_key(each) for each in different)}
    assert len(keys) == 1 + len(different)
    two = NamedArrays.of(a=values[:, :2], b=values[:, 2:])
    assert input_key(two) == input_key(NamedArrays.of(b=values[:, 2:], a=values[:, :2]))
    assert input_key(two) != input_key(NamedArrays.of(a=values[:, :1], b=values[:, 1:]))


def test_an_array_of_objects_has_no_key_and_is_never_cached() -> None:
    texts = np.asarray([["a"], ["b"]], dtype=object)
    assert input_key(NamedArrays.of(t=texts)) is None

    async def scenario() -> None:
        cache, engine = cache_of(), GatedDoublingEngine(V1)
        request = InferenceRequest("m", V1, NamedArrays.of(t=np.asarray([1], dtype=object)),
                                   "normal", time.monotonic() + 30.0, "r")  # fmt: skip
        await answer(cache, engine, request)
        await answer(cache, engine, request)
        assert engine.calls == 2
        assert len(cache) == 0

    asyncio.run(scenario())


async def test_a_repeated_input_is_answered_without_the_engine() -> None:
    cache, engine = cache_of(), GatedDoublingEngine(V1)
    first = await answer(cache, engine, request_of([1.0, 2.0]))
    again = await answer(cache, engine, request_of([1.0, 2.0]))
    assert engine.calls == 1
    assert again.version == V1
    np.testing.assert_array_equal(again.outputs["x"], first.outputs["x"])
    assert not again.outputs["x"].flags.writeable  # every hit shares it
    assert (counted(cache, "hits_total"), counted(cache, "misses_total")) == (1, 1)
    await answer(cache, engine, request_of([1.0, 3.0]))
    assert engine.calls == 2


async def test_an_answer_is_found_only_by_its_model_and_version() -> None:
    """After a switch to V2 (a request validated against V2), V1's answer is not found."""
    cache, engine = cache_of(), GatedDoublingEngine(V1)
    await answer(cache, engine, request_of([1.0]))
    engine.version = V2
    after_switch = await answer(cache, engine, request_of([1.0], version=V2))
    assert after_switch.version == V2
    assert engine.calls == 2
    other_model = await answer(cache, engine, request_of([1.0], model="n"))
    assert engine.calls == 3
    assert other_model.version == V2
    back = await answer(cache, engine, request_of([1.0], version=V1))  # rolled back: kept
    assert back.version == V1
    assert engine.calls == 3


async def test_no_answer_is_given_from_the_cache_once_its_version_is_switched_away() -> None:
    """Validated against V1, looked up after a switch to V2 (its handler ran meanwhile): to
    the engine, which refuses it or computes it, as without a cache; nor does it wait for an
    identical request in flight."""
    cache, engine = cache_of(), GatedDoublingEngine(V1)
    await answer(cache, engine, request_of([1.0]))
    await answer(cache, engine, request_of([1.0]), served_version=V2)
    assert engine.calls == 2
    await answer(cache, engine, request_of([1.0]))
    assert engine.calls == 2
    engine.gate.clear()
    first = asyncio.ensure_future(answer(cache, engine, request_of([2.0])))
    await wait_until(lambda: engine.calls == 3)
    late = asyncio.ensure_future(answer(cache, engine, request_of([2.0]), served_version=V2))
    await wait_until(lambda: engine.calls == 4)
    assert cache.waiting == 0
    engine.gate.set()
    await asyncio.gather(first, late)


async def test_an_answer_is_kept_under_the_version_that_computed_it() -> None:
    """Validated against V1 but computed by V2 (switched meanwhile, interchangeable): kept as
    V2's answer, so a request validated against V1 computes its own."""
    cache, engine = cache_of(), GatedDoublingEngine(V2)
    assert (await answer(cache, engine, request_of([1.0], version=V1))).version == V2
    assert (await answer(cache, engine, request_of([1.0], version=V2))).version == V2
    assert engine.calls == 1
    engine.version = V1
    assert (await answer(cache, engine, request_of([1.0], version=V1))).version == V1
    assert engine.calls == 2


async def test_only_the_models_named_are_cached() -> None:
    cache, engine = cache_of(models=frozenset({"m"})), GatedDoublingEngine(V1)
    for _ in range(2):
        await answer(cache, engine, request_of([1.0], model="n"))
    assert engine.calls == 2
    assert len(cache) == 0
    for _ in range(2):
        await answer(cache, engine, request_of([1.0], model="m"))
    assert engine.calls == 3


async def test_the_least_recently_used_answer_makes_room_and_bytes_stay_bounded() -> None:
    # One entry: the key's bytes and name, the output's bytes, the overhead.
    entry_bytes = ENTRY_OVERHEAD_BYTES + (4 + 1) + 4
    cache, engine = cache_of(capacity_bytes=2 * entry_bytes + 1), GatedDoublingEngine(V1)
    for value in (1.0, 2.0):
        await answer(cache, engine, request_of([value]))
    await answer(cache, engine, request_of([1.0]))  # used: 2.0 is now the least recent
    await answer(cache, engine, request_of([3.0]))
    assert (len(cache), cache.size_bytes, engine.calls) == (2, 2 * entry_bytes, 3)
    assert counted(cache, "evictions_total") == 1
    assert counted(cache, "bytes") == 2 * entry_bytes
    await answer(cache, engine, request_of([1.0]))
    assert engine.calls == 3
    await answer(cache, engine, request_of([2.0]))
    assert engine.calls == 4


async def test_identical_requests_in_flight_are_computed_once() -> None:
    cache, engine = cache_of(), GatedDoublingEngine(V1, open_gate=False)
    answers = [
        asyncio.ensure_future(answer(cache, engine, request_of([5.0]))) for _ in range(IDENTICAL)
    ]
    await wait_until(lambda: cache.waiting == IDENTICAL - 1)
    engine.gate.set()
    results = await asyncio.gather(*answers)
    assert engine.calls == 1
    assert {float(result.outputs["x"][0, 0]) for result in results} == {10.0}
    assert counted(cache, "hits_total") == IDENTICAL - 1


async def test_a_failed_computation_is_not_kept_and_its_waiters_try_once_more() -> None:
    cache, engine = cache_of(), GatedDoublingEngine(V1, open_gate=False, failures=1)
    first = asyncio.ensure_future(answer(cache, engine, request_of([5.0])))
    waiters = [asyncio.ensure_future(answer(cache, engine, request_of([5.0]))) for _ in range(8)]
    await wait_until(lambda: cache.waiting == 8)
    engine.gate.set()
    with pytest.raises(InferenceError):
        await first
    results = await asyncio.gather(*waiters)  # one of them computed it again, for all
    assert engine.calls == 2
    assert all(result.outputs["x"][0, 0] == 10.0 for result in results)


async def test_waiters_of_a_computation_that_keeps_failing_get_its_error_after_one_retry() -> None:
    cache, engine = cache_of(), GatedDoublingEngine(V1, open_gate=False, failures=1000)
    first = asyncio.ensure_future(answer(cache, engine, request_of([5.0])))
    waiters = [asyncio.ensure_future(answer(cache, engine, request_of([5.0]))) for _ in range(3)]
    await wait_until(lambda: cache.waiting == 3)
    engine.gate.set()
    outcomes = await asyncio.gather(first, *waiters, return_exceptions=True)
    assert all(isinstance(outcome, InferenceError) for outcome in outcomes)
    assert engine.calls <= 1 + 2 * len(waiters)  # each waiter computes at most once more
    assert len(cache) == 0


async def test_a_cancelled_computation_leaves_its_waiters_an_answer() -> None:
    """The first request's client left: its waiters are not cancelled with it."""
    cache, engine = cache_of(), GatedDoublingEngine(V1, open_gate=False)
    first = asyncio.ensure_future(answer(cache, engine, request_of([5.0])))
    waiter = asyncio.ensure_future(answer(cache, engine, request_of([5.0])))
    await wait_until(lambda: cache.waiting == 1)
    first.cancel()
    await wait_until(lambda: engine.calls == 2)  # the waiter computes it now
    engine.gate.set()
    assert (await waiter).outputs["x"][0, 0] == 10.0
    assert first.cancelled()
    assert len(cache) == 1


async def test_a_waiter_whose_deadline_passes_is_answered_504_and_the_first_goes_on() -> None:
    cache, engine = cache_of(), GatedDoublingEngine(V1, open_gate=False)
    first = asyncio.ensure_future(answer(cache, engine, request_of([5.0])))
    await wait_until(lambda: engine.calls == 1)
    soon = request_of([5.0], deadline_s=time.monotonic() + 0.1)
    with pytest.raises(DeadlineExceededError, match="an identical request was computed"):
        await answer(cache, engine, soon)
    engine.gate.set()
    assert (await first).version == V1
    assert len(cache) == 1


def test_the_settings_turn_it_on_only_with_the_models_named() -> None:
    assert ResponseCache.from_settings(load_settings(), FrontendMetrics()) is None
    with pytest.raises(SettingsError, match="response_cache_models"):
        load_settings(response_cache_mb=8)
    cache = ResponseCache.from_settings(
        load_settings(response_cache_mb=8, response_cache_models="digits, textenc"),
        FrontendMetrics(),
    )
    assert cache is not None
    assert cache.models == {"digits", "textenc"}
    assert cache.capacity_bytes == 8 * 1024 * 1024
    every = ResponseCache.from_settings(
        load_settings(response_cache_mb=1, response_cache_models="*"), FrontendMetrics()
    )
    assert every is not None
    assert every.models is None
    with pytest.raises(SettingsError, match="plain identifiers"):
        load_settings(response_cache_mb=1, response_cache_models="digits@abc")
