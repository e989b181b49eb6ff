"""The bridge between a front end and an engine, both in this test's event loop, over a real
Unix socket: rows, errors and cancels cross it; a lost or silent engine fails what waits on it
at once; the client reconnects to the engine that replaces it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from service.bridge import contract, wire
from service.bridge.client import BridgeClient
from service.bridge.interface import InferenceRequest
from service.bridge.server import BridgeServer
from service.config import Settings
from service.engine.engine import Engine
from service.errors import (
    DeadlineExceededError,
    EngineUnavailableError,
    InvalidInputError,
    NotReadyError,
    QueueFullError,
)
from service.manifest import Architecture, TensorSpec
from service.metrics import EngineMetrics
from service.packaging.package import Packager
from service.tensors import NamedArrays
from tests.fixtures import sample_total, wait_until
from tests.torch_models import (
    FEATURES,
    HANG_ENTERED,
    HANG_RELEASE,
    HANG_VALUE,
    PairClassifier,
    package_pair_classifier,
)

PROMPTLY_S = 5.0


def package(
    repository: Path, architecture: str, labels: tuple[str, ...] | None = None, retrained: str = ""
) -> str:
    """``architecture`` packaged as ``fault``; ``retrained``: its weights file differs (in its
    metadata), nothing else does."""
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "empty.safetensors"
        metadata = {"architecture": architecture} | ({"retrained": retrained} if retrained else {})
        save_file({}, str(weights), metadata=metadata)
        return (
            Packager(repository)
            .package(
                name="fault",
                artifact=weights,
                format="safetensors",
                architecture=Architecture(import_path=architecture),
                inputs=(TensorSpec(name="x", dtype="float32", shape=(-1, FEATURES)),),
                outputs=(
                    TensorSpec(name="y", dtype="float32", shape=(-1, FEATURES), labels=labels),
                ),
            )
            .version
        )


@pytest.fixture
def hang_released() -> Iterator[None]:
    HANG_RELEASE.clear()
    HANG_ENTERED.clear()
    yield
    HANG_RELEASE.set()


@contextlib.asynccontextmanager
async def engine_behind_a_socket(
    socket_path: Path, repository: Path, **settings: object
) -> AsyncIterator[tuple[Engine, BridgeServer]]:
    values: dict[str, object] = {
        "model_repository": repository,
        "model_name": "fault",
        "device": "cpu",
        "warmup_batch_sizes": (1,),
        "max_wait_ms": 1.0,
    }
    engine = Engine(Settings(**(values | settings)), EngineMetrics())  # type: ignore[arg-type]
    server = BridgeServer(engine, socket_path, heartbeat_interval_s=0.2)
    engine.add_listener(server.status_changed)
    await server.start()
    await engine.start()
    try:
        yield engine, server
    finally:
        HANG_RELEASE.set()
        await engine.shut_down()
        await server.close()


@contextlib.asynccontextmanager
async def client_of(
    socket_path: Path, heartbeat_timeout_s: float = 10.0
) -> AsyncIterator[BridgeClient]:
    client = BridgeClient(
        [(socket_path, "cpu")], heartbeat_timeout_s=heartbeat_timeout_s, request_timeout_ms=5_000
    )
    await client.start()
    try:
        async with asyncio.timeout(PROMPTLY_S):
            await client.wait_until_settled()
        yield client
    finally:
        await client.close()


def request(client: BridgeClient, rows: np.ndarray, deadline_s: float = 5.0) -> InferenceRequest:
    model = client.status().model
    assert model is not None
    return InferenceRequest(
        model=model.manifest.name,
        version=model.manifest.version,
        instances=NamedArrays({"x": rows.astype(np.float32)}),
        priority="normal",
        deadline_s=time.monotonic() + deadline_s,
        request_id="test",
    )


def value_rows(value: float, count: int = 1) -> np.ndarray:
    return np.full((count, FEATURES), value, dtype=np.float32)


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # Unix socket paths are limited to about 100 characters: pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="bridge-") as folder:
        yield Path(folder) / "engine.sock"


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    package(tmp_path, "tests.torch_models:HangsOnValue")
    return tmp_path


async def test_rows_cross_the_bridge_and_a_request_too_large_for_a_batch_is_rejoined(
    socket_path: Path, repository: Path
) -> None:
    async with (
        engine_behind_a_socket(socket_path, repository, max_batch_size=4),
        client_of(socket_path) as client,
    ):
        rows = np.arange(10 * FEATURES, dtype=np.float32).reshape(10, FEATURES) / 4  # no 13
        result = await client.infer(request(client, rows))
        assert result.outputs.names == ("y",)
        np.testing.assert_array_equal(result.outputs["y"], 2 * rows + 1)
        assert result.version == client.status().model.manifest.version  # type: ignore[union-attr]
        assert client.status().ready
        assert client.engines()[0].pid is not None


async def test_several_named_inputs_and_outputs_of_different_dtypes_cross_the_bridge(
    socket_path: Path, tmp_path: Path
) -> None:
    package_pair_classifier(tmp_path)
    ids = np.array([[5, 7, 9, 0, 0], [11, 12, 13, 14, 15], [3, 0, 0, 0, 0]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    async with (
        engine_behind_a_socket(socket_path, tmp_path, model_name="pairs", max_batch_size=2),
        client_of(socket_path) as client,
    ):
        model = client.status().model
        assert model is not None
        instances = NamedArrays({"input_ids": ids, "attention_mask": mask})
        result = await client.infer(
            InferenceRequest(
                model="pairs",
                version=model.manifest.version,
                instances=instances,
                priority="normal",
                deadline_s=time.monotonic() + 5.0,
                request_id="pairs",
            )
        )

    with torch.inference_mode():
        expected = PairClassifier()(torch.from_numpy(ids), torch.from_numpy(mask))
    assert result.outputs.names == ("logits", "label")
    assert result.outputs["logits"].dtype == np.float32
    assert result.outputs["label"].dtype == np.int64
    assert result.outputs["logits"].shape == (3, 3)
    assert result.outputs["label"].shape == (3,)
    # Three rows in batches of two: split by the engine, rejoined per name in order.
    np.testing.assert_allclose(
        result.outputs["logits"], expected["logits"].numpy(), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(result.outputs["label"], expected["label"].numpy())


async def test_errors_cross_with_their_status_code_and_retry_after(
    socket_path: Path, repository: Path, hang_released: None
) -> None:
    async with (
        engine_behind_a_socket(
            socket_path, repository, max_queue_size=1, max_instances_per_request=64
        ) as (engine, _),
        client_of(socket_path) as client,
    ):
        blocker = asyncio.create_task(client.infer(request(client, value_rows(HANG_VALUE))))
        served = engine.served
        assert served is not None
        await wait_until(HANG_ENTERED.is_set)  # the blocker holds the device thread
        queued = asyncio.create_task(client.infer(request(client, value_rows(1.0))))
        await wait_until(lambda: served.batcher.queue_depth == 1)
        with pytest.raises(QueueFullError) as refused:
            await client.infer(request(client, value_rows(2.0)))
        assert refused.value.status_code == 429
        assert refused.value.headers["Retry-After"] == "1"
        with pytest.raises(DeadlineExceededError):
            await client.infer(request(client, value_rows(3.0), deadline_s=-1.0))
        HANG_RELEASE.set()
        async with asyncio.timeout(PROMPTLY_S):
            await asyncio.gather(blocker, queued)


async def test_a_cancelled_request_leaves_the_engines_queue_uncomputed(
    socket_path: Path, repository: Path, hang_released: None
) -> None:
    async with (
        engine_behind_a_socket(socket_path, repository) as (engine, _),
        client_of(socket_path) as client,
    ):
        served = engine.served
        assert served is not None
        blocker = asyncio.create_task(client.infer(request(client, value_rows(HANG_VALUE))))
        await wait_until(HANG_ENTERED.is_set)
        leaving = asyncio.create_task(client.infer(request(client, value_rows(5.0))))
        await wait_until(lambda: served.batcher.queue_depth == 1)
        leaving.cancel()
        await wait_until(lambda: served.batcher.queue_depth == 0)
        dropped = sample_total(
            engine.state.metrics.registry,
            "batchserve_dropped_requests_total",
            {"reason": "cancelled"},
        )
        assert dropped == 1
        HANG_RELEASE.set()
        async with asyncio.timeout(PROMPTLY_S):
            await blocker
        rows = sample_total(engine.state.metrics.registry, "batchserve_batch_size_rows_sum")
        assert rows == 1, "only the blocker's row was computed"


async def test_a_front_end_that_disconnects_has_its_queued_requests_dropped(
    socket_path: Path, repository: Path, hang_released: None
) -> None:
    async with engine_behind_a_socket(socket_path, repository) as (engine, _):
        served = engine.served
        assert served is not None
        async with client_of(socket_path) as leaving, client_of(socket_path) as staying:
            blocker = asyncio.create_task(staying.infer(request(staying, value_rows(HANG_VALUE))))
            await wait_until(HANG_ENTERED.is_set)
            queued = [
                asyncio.create_task(leaving.infer(request(leaving, value_rows(value))))
                for value in (1.0, 2.0, 3.0)
            ]
            await wait_until(lambda: served.batcher.queue_depth == 3)
        await wait_until(lambda: served.batcher.queue_depth == 0)
        for task in queued:
            with pytest.raises((asyncio.CancelledError, EngineUnavailableError)):
                await task
        HANG_RELEASE.set()
        async with asyncio.timeout(PROMPTLY_S):
            with pytest.raises((asyncio.CancelledError, EngineUnavailableError)):
                await blocker  # its own client has closed too
        rows = sample_total(engine.state.metrics.registry, "batchserve_batch_size_rows_sum")
        assert rows == 1


@pytest.mark.parametrize("shadowed", [False, True])
async def test_a_front_end_that_left_is_not_kept_by_the_engine(
    socket_path: Path, repository: Path, shadowed: bool
) -> None:
    """Its connection (buffers and all) is freed once it left, however many came and went,
    also while a shadow copies its requests; its load no longer counts."""
    served = package(repository, "tests.torch_models:HangsOnValue")  # the fixture's, again
    candidate = package(repository, "tests.torch_models:HangsOnValue", retrained="yes")
    async with engine_behind_a_socket(socket_path, repository, model_version=served) as (
        engine,
        server,
    ):
        if shadowed:
            await engine.start_shadow("fault", candidate, 100)
        left: list[weakref.ref[object]] = []
        for value in (1.0, 2.0, 3.0):
            async with client_of(socket_path) as client:
                answer = await client.infer(request(client, value_rows(value)))
                np.testing.assert_array_equal(answer.outputs["y"], 2 * value_rows(value) + 1)
                (connection,) = server._connections
                left.append(weakref.ref(connection))
                del connection
            await wait_until(lambda: not server._connections)
        registry = engine.state.metrics.registry
        copied = 3 if shadowed else 0  # each through a tap of its front end's
        await wait_until(
            lambda: sample_total(registry, "batchserve_shadow_compared_total") == copied
        )
        gc.collect()
        assert [ref() for ref in left] == [None, None, None]
        assert engine.state.frontend_loads == {}


async def test_a_lost_engine_fails_what_waits_on_it_at_once_and_its_replacement_serves(
    socket_path: Path, repository: Path, hang_released: None
) -> None:
    async with client_of_engine(socket_path, repository) as (client, server, first_engine):
        waiting = asyncio.create_task(client.infer(request(client, value_rows(HANG_VALUE))))
        later = request(client, value_rows(1.0))
        await wait_until(HANG_ENTERED.is_set)  # the engine is busy with it
        lost_at_s = time.monotonic()
        await server.close()  # the engine's end goes away while its model is still busy
        with pytest.raises(EngineUnavailableError):
            await waiting
        assert time.monotonic() - lost_at_s < PROMPTLY_S
        assert client.status().phase == "down"
        with pytest.raises(EngineUnavailableError):
            await client.infer(later)
        HANG_RELEASE.set()
        await first_engine.shut_down()

        async with engine_behind_a_socket(socket_path, repository):
            async with asyncio.timeout(PROMPTLY_S):
                await client.wait_until_settled()
            result = await client.infer(request(client, value_rows(1.0)))
            np.testing.assert_array_equal(result.outputs["y"], value_rows(3.0))


@contextlib.asynccontextmanager
async def client_of_engine(
    socket_path: Path, repository: Path
) -> AsyncIterator[tuple[BridgeClient, BridgeServer, Engine]]:
    async with (
        engine_behind_a_socket(socket_path, repository) as (engine, server),
        client_of(socket_path) as client,
    ):
        yield client, server, engine


async def test_an_engine_that_goes_silent_is_given_up_at_the_heartbeat_timeout(
    socket_path: Path,
) -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # takes the connection and never says a word

    server = await asyncio.start_unix_server(silent, path=str(socket_path))
    client = BridgeClient([(socket_path, "cpu")], heartbeat_timeout_s=0.5, request_timeout_ms=5_000)
    await client.start()
    try:
        await wait_until(lambda: bool(accepted))
        assert client.status().phase == "connecting"
        await wait_until(lambda: client.status().phase == "down", timeout_s=PROMPTLY_S)
        assert "heartbeat" in (client.status().detail or "")
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
        await asyncio.sleep(0.05)  # a connection accepted last has its handler run first
        for writer in accepted:
            writer.close()
        # Closed on this loop, not left to a later test's garbage collection ("loop is closed").
        await asyncio.gather(*(writer.wait_closed() for writer in accepted), return_exceptions=True)


async def test_a_request_validated_against_the_version_just_replaced_is_still_served(
    socket_path: Path, tmp_path: Path
) -> None:
    first = package(tmp_path, "tests.torch_models:HangsOnValue")
    second = package(tmp_path, "tests.torch_models:RaisesOnNegative")  # the same inputs
    async with (
        engine_behind_a_socket(socket_path, tmp_path, model_version=first) as (engine, _),
        client_of(socket_path) as client,
    ):
        validated_against_first = request(client, value_rows(1.0))
        await engine.switch("fault", second)
        result = await client.infer(validated_against_first)
        assert result.version == second
        np.testing.assert_array_equal(result.outputs["y"], value_rows(3.0))
        with pytest.raises(NotReadyError, match="other is not served by this engine now"):
            await client.infer(dataclasses.replace(validated_against_first, model="other"))


async def test_a_request_validated_against_a_version_answering_otherwise_is_refused(
    socket_path: Path, tmp_path: Path
) -> None:
    """The same inputs, but labelled outputs: the front end would postprocess the answer for
    the version it validated against, so the engine asks it to retry instead."""
    first = package(tmp_path, "tests.torch_models:HangsOnValue")
    labelled = package(tmp_path, "tests.torch_models:HangsOnValue", labels=("a", "b", "c", "d"))
    async with (
        engine_behind_a_socket(socket_path, tmp_path, model_version=first) as (engine, _),
        client_of(socket_path) as client,
    ):
        validated_against_first = request(client, value_rows(1.0))
        await engine.switch("fault", labelled)
        with pytest.raises(NotReadyError, match="outputs or handler differ; retry"):
            await client.infer(validated_against_first)


def test_a_front_ends_load_counts_only_while_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.engine import state as engine_state

    now = [100.0]
    monkeypatch.setattr(engine_state.time, "monotonic", lambda: now[0])
    held = engine_state.EngineState(
        settings=Settings(device="cpu"),
        metrics=EngineMetrics(),
        store=None,
        device="cpu",  # type: ignore[arg-type]
    )
    held.frontend_loads["a"] = (30, 100.0)
    held.frontend_loads["b"] = (5, 99.99)
    assert held.expected_requests() == 35
    now[0] = 100.0 + engine_state.LOAD_FRESH_S + 0.001  # a has gone quiet too
    assert held.expected_requests() == 0


async def test_requests_of_one_loop_turn_cross_in_one_frame_and_a_batch_answers_in_one(
    socket_path: Path, repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Coalesced frames: 16 requests submitted together cost the engine one SUBMITS frame,
    and their batch comes back as one ANSWERS frame."""
    frames: list[str] = []
    for name in ("decode_submits", "decode_answers"):
        decode = getattr(contract, name)
        monkeypatch.setattr(
            contract,
            name,
            lambda header, decode=decode, name=name: frames.append(name) or decode(header),
        )
    async with (
        engine_behind_a_socket(socket_path, repository, max_batch_size=16) as (engine, _),
        client_of(socket_path) as client,
    ):
        rows = [value_rows(value / 4) for value in range(16)]  # never HANG_VALUE
        async with asyncio.timeout(PROMPTLY_S):
            results = await asyncio.gather(*(client.infer(request(client, r)) for r in rows))
        for row, result in zip(rows, results, strict=True):
            np.testing.assert_array_equal(result.outputs["y"], 2 * row + 1)
        assert frames == ["decode_submits", "decode_answers"]
        batches = sample_total(engine.state.metrics.registry, "batchserve_batch_size_rows_count")
        assert batches == 1


async def test_answers_packed_as_one_block_give_each_front_end_exactly_its_own_rows(
    socket_path: Path, repository: Path
) -> None:
    """Two front ends' frames of requests of 1 to 3 rows share batches; each batch's answers
    for a front end are packed as one block (``DataPacker.pack_all``): every request gets
    its own rows back, in its own row count."""
    async with (
        engine_behind_a_socket(socket_path, repository, max_batch_size=16) as _,
        client_of(socket_path) as first,
        client_of(socket_path) as second,
    ):
        sent = [
            (client, value_rows(index + 0.25 + 100 * side, count=1 + index % 3))  # never 13
            for index in range(24)
            for side, client in enumerate((first, second))
        ]
        async with asyncio.timeout(PROMPTLY_S):
            results = await asyncio.gather(
                *(client.infer(request(client, rows)) for client, rows in sent)
            )
    for (_, rows), result in zip(sent, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], 2 * rows + 1)


async def test_a_request_refused_in_a_coalesced_frame_fails_alone(
    socket_path: Path, repository: Path
) -> None:
    """One SUBMITS frame, three requests: the one for a model not served is refused (503)
    and the others are answered."""
    async with engine_behind_a_socket(socket_path, repository), client_of(socket_path) as client:
        stray = dataclasses.replace(request(client, value_rows(1.0)), model="elsewhere")
        outcomes = await asyncio.gather(
            client.infer(request(client, value_rows(1.0))),
            client.infer(stray),
            client.infer(request(client, value_rows(2.0))),
            return_exceptions=True,
        )
    assert isinstance(outcomes[1], NotReadyError)
    for outcome, value in ((outcomes[0], 1.0), (outcomes[2], 2.0)):
        assert not isinstance(outcome, BaseException)
        np.testing.assert_array_equal(outcome.outputs["y"], 2 * value_rows(value) + 1)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff" * 64,  # no frame at all: a header length past the limit
        bytes(wire.encode_typed(wire.Kind.SUBMITS, b"\xc1")[0]),  # not msgpack
        bytes(wire.encode_typed(wire.Kind.SUBMITS, b"\x93\x01\x02\x03")[0]),  # wrong shape
        bytes(wire.encode_typed(wire.Kind.ANSWERS, msgspec.msgpack.encode([[]]))[0]),
    ],
    ids=["not-a-frame", "not-msgpack", "not-a-submits", "a-kind-front-ends-never-send"],
)
async def test_a_corrupt_frame_closes_only_its_own_connection(
    socket_path: Path, repository: Path, garbage: bytes
) -> None:
    async with engine_behind_a_socket(socket_path, repository), client_of(socket_path) as client:
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        writer.write(garbage)
        async with asyncio.timeout(PROMPTLY_S):
            while await reader.read(65536):  # its status frames, then the engine closes it
                pass
        writer.close()
        result = await client.infer(request(client, value_rows(3.0)))
        np.testing.assert_array_equal(result.outputs["y"], 2 * value_rows(3.0) + 1)


async def test_the_engine_groups_requests_by_their_arrays(
    socket_path: Path, repository: Path
) -> None:
    """No group crosses the bridge (a front end's claim could have put unequal shapes in one
    batch, or kept equal ones apart): the engine groups by the arrays, so two requests of
    one shape share a batch."""
    async with (
        engine_behind_a_socket(socket_path, repository, max_batch_size=4) as (engine, _),
        client_of(socket_path) as client,
    ):
        claimed = [request(client, value_rows(value)) for value in (1.0, 2.0)]
        results = await asyncio.gather(*(client.infer(each) for each in claimed))
        for value, result in zip((1.0, 2.0), results, strict=True):
            np.testing.assert_array_equal(result.outputs["y"], 2 * value_rows(value) + 1)
        batches = sample_total(engine.state.metrics.registry, "batchserve_batch_size_rows_count")
        assert batches == 1


async def test_one_frame_of_mixed_requests_answers_each_as_it_would_alone(
    socket_path: Path, repository: Path
) -> None:
    """The engine reuses what the previous request of a frame asked (its model, its group
    from its instance shape): a frame that changes model, shape and kind mid-way still gets
    each request's own answer or refusal. One SUBMITS frame: rows of two widths (two groups,
    never one batch: no batch fails), a model not served (503), an input of the wrong name
    (422), and a request in several chunks (answered after the others of its batch)."""
    async with (
        engine_behind_a_socket(socket_path, repository, max_batch_size=4) as (engine, _),
        client_of(socket_path) as client,
    ):
        wide = np.full((2, FEATURES + 2), 1.5, dtype=np.float32)
        large = np.arange(10 * FEATURES, dtype=np.float32).reshape(10, FEATURES) / 4  # no 13
        stray = dataclasses.replace(request(client, value_rows(3.0)), model="elsewhere")
        misnamed = dataclasses.replace(
            request(client, value_rows(4.0)), instances=NamedArrays({"z": value_rows(4.0)})
        )
        sent = [value_rows(1.0), wide, value_rows(2.0, count=2), large, value_rows(5.0), wide]
        async with asyncio.timeout(PROMPTLY_S):
            outcomes = await asyncio.gather(
                *(client.infer(request(client, rows)) for rows in sent[:3]),
                client.infer(stray),
                client.infer(misnamed),
                *(client.infer(request(client, rows)) for rows in sent[3:]),
                return_exceptions=True,
            )
        assert isinstance(outcomes[3], NotReadyError)
        assert isinstance(outcomes[4], InvalidInputError)
        answered = outcomes[:3] + outcomes[5:]
        for rows, outcome in zip(sent, answered, strict=True):
            assert not isinstance(outcome, BaseException)
            np.testing.assert_array_equal(outcome.outputs["y"], 2 * rows + 1)
        registry = engine.state.metrics.registry
        assert sample_total(registry, "batchserve_batch_failures_total") == 0


async def test_a_request_sorted_by_length_crosses_back_in_its_own_order(
    socket_path: Path, tmp_path: Path
) -> None:
    """Rows of three length buckets in one request: the engine queues a part per bucket
    (three batches) and the front end gets every row back in its place, each as the model
    answers it alone."""
    package_pair_classifier(tmp_path)
    lengths = [3, 30, 5, 20, 2, 12]
    ids = np.zeros((len(lengths), max(lengths)), dtype=np.int64)
    for row, length in enumerate(lengths):
        ids[row, :length] = np.arange(1, length + 1) + row
    mask = (ids != 0).astype(np.int64)
    async with (
        engine_behind_a_socket(socket_path, tmp_path, model_name="pairs") as (engine, _),
        client_of(socket_path) as client,
    ):
        sent = dataclasses.replace(
            request(client, value_rows(0.0)),
            instances=NamedArrays({"input_ids": ids, "attention_mask": mask}),
        )
        async with asyncio.timeout(PROMPTLY_S):
            result = await client.infer(sent)
        batches = sample_total(engine.state.metrics.registry, "batchserve_batch_size_rows_count")
    model = PairClassifier()
    for row, length in enumerate(lengths):
        with torch.no_grad():
            alone = model(torch.from_numpy(ids[row : row + 1, :length]), torch.ones(1, length))
        np.testing.assert_allclose(result.outputs["logits"][row], alone["logits"][0], atol=1e-6)
    assert batches == 3  # buckets 8, 16 and 32
