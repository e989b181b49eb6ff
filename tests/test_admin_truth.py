"""What the admin API answers is what the server serves, after any restart.

An engine commits a switch by publishing what it serves (``bridge/published.py``) before it
answers; when its answer is lost with it, the front end decides from that record. Before, the
engine killed after committing answered the switch 503 "connection lost" while its replacement
served the new version; and a rollback asked while the engine restarted was a false 409
("no earlier version was served").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Hashable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import save_file

from service.bridge.client import BridgeClient
from service.bridge.interface import EngineStatus, InferenceRequest, Phase, SwitchResult
from service.bridge.published import PublishedVersion, read_published, recorded_version
from service.bridge.server import BridgeServer, QueuedRequest
from service.config import Settings
from service.engine.engine import Engine
from service.errors import ConflictError, EngineUnavailableError, ServiceError
from service.manifest import Architecture, Manifest, TensorSpec
from service.metrics import EngineMetrics
from service.packaging.package import Packager
from service.processes import RUN_DIR_ENV
from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.fixtures import wait_until
from tests.processes import (
    alive,
    engine_pids,
    serve_with_engines,
    wait_for,
    wait_until_serving,
)
from tests.torch_models import FEATURES

PROMPTLY_S = 10.0
TOKEN = "admin-truth-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def package(repository: Path, architecture: str) -> str:
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "empty.safetensors"
        save_file({}, str(weights), metadata={"architecture": architecture})
        return (
            Packager(repository)
            .package(
                name="pair",
                artifact=weights,
                format="safetensors",
                architecture=Architecture(import_path=architecture),
                inputs=(TensorSpec(name="x", dtype="float32", shape=(-1, FEATURES)),),
                outputs=(TensorSpec(name="y", dtype="float32", shape=(-1, FEATURES)),),
            )
            .version
        )


class EngineKilledAtCommit:
    """An engine whose process dies when asked to commit a switch: after committing it
    (``after_commit``: the switch is published, the answer never sent) or before."""

    def __init__(self, engine: Engine, after_commit: bool) -> None:
        self.engine = engine
        self.after_commit = after_commit
        self.server: BridgeServer | None = None
        self._dying: asyncio.Task[None] | None = None

    def status(self) -> EngineStatus:
        return self.engine.status()

    def enqueue(self, request: InferenceRequest, source: Hashable) -> tuple[QueuedRequest, str]:
        return self.engine.enqueue(request, source)

    def frontend_left(self, sink: Any) -> None:
        self.engine.frontend_left(sink)

    async def prepare(self, name: str, version: str) -> Manifest:
        return await self.engine.prepare(name, version)

    async def commit(self) -> SwitchResult:
        if self.after_commit:
            await self.engine.commit()
        assert self.server is not None
        self._dying = asyncio.create_task(self.server.close())  # every connection drops
        await asyncio.Event().wait()  # no answer, ever
        raise AssertionError("unreachable")

    async def abort(self) -> None:
        await self.engine.abort()

    async def unload(self, name: str) -> str:
        return await self.engine.unload(name)


@pytest.fixture
def run_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # Unix socket paths are limited to about 100 characters: pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="run-") as folder:
        monkeypatch.setenv(RUN_DIR_ENV, folder)
        yield Path(folder)


@pytest.fixture
def versions(tmp_path: Path) -> tuple[Path, str, str]:
    first = package(tmp_path, "tests.torch_models:HangsOnValue")
    second = package(tmp_path, "tests.torch_models:RaisesOnNegative")
    return tmp_path, first, second


def engine_settings(repository: Path, version: str) -> Settings:
    return Settings(
        model_repository=repository,
        model_name="pair",
        model_version=version,
        device="cpu",
        warmup_batch_sizes=(1,),
    )


@contextlib.asynccontextmanager
async def started_engine(
    settings: Settings, socket: Path, after_commit: bool | None = None
) -> AsyncIterator[tuple[Engine, BridgeServer]]:
    """An engine behind ``socket``; dying at its next commit unless ``after_commit`` is None."""
    engine = Engine(settings, EngineMetrics())
    killed = None if after_commit is None else EngineKilledAtCommit(engine, after_commit)
    server = BridgeServer(killed or engine, socket, heartbeat_interval_s=0.2)
    if killed is not None:
        killed.server = server
    engine.add_listener(server.status_changed)
    await server.start()
    await engine.start()
    try:
        yield engine, server
    finally:
        await engine.shut_down()
        await server.close()


@contextlib.asynccontextmanager
async def client_of(socket: Path) -> AsyncIterator[BridgeClient]:
    client = BridgeClient([(socket, "cpu")], heartbeat_timeout_s=10.0, request_timeout_ms=5_000)
    await client.start()
    try:
        async with asyncio.timeout(PROMPTLY_S):
            await client.wait_until_settled()
        yield client
    finally:
        await client.close()


async def served_after_restart(settings: Settings, socket: Path, client: BridgeClient) -> str:
    """The version a replacement engine serves (it reads the published record)."""
    async with started_engine(settings, socket):
        async with asyncio.timeout(PROMPTLY_S):
            await wait_until(lambda: client.status().ready, timeout_s=PROMPTLY_S)
        model = client.status().model
        assert model is not None
        return model.manifest.version


async def test_a_switch_whose_engine_dies_after_committing_is_reported_done_and_survives(
    run_dir: Path, versions: tuple[Path, str, str]
) -> None:
    repository, first, second = versions
    settings = engine_settings(repository, first)
    socket = run_dir / "engine-0.sock"
    async with client_of_started(settings, socket, after_commit=True) as client:
        result = await client.switch("pair", second)
        assert result.serving.version == second
        assert result.replaced == f"pair@{first}"
        assert await served_after_restart(settings, socket, client) == second


async def test_a_switch_whose_engine_dies_before_committing_is_reported_failed_and_undone(
    run_dir: Path, versions: tuple[Path, str, str]
) -> None:
    repository, first, second = versions
    settings = engine_settings(repository, first)
    socket = run_dir / "engine-0.sock"
    async with client_of_started(settings, socket, after_commit=False) as client:
        with pytest.raises(EngineUnavailableError, match="did not take place"):
            await client.switch("pair", second)
        assert await served_after_restart(settings, socket, client) == first
    assert recorded_version(read_published(), "pair") == first


@contextlib.asynccontextmanager
async def client_of_started(
    settings: Settings, socket: Path, after_commit: bool
) -> AsyncIterator[BridgeClient]:
    async with (
        started_engine(settings, socket, after_commit=after_commit),
        client_of(socket) as client,
    ):
        yield client


async def test_a_rollback_while_the_engine_restarts_is_503_not_a_false_409(
    run_dir: Path, versions: tuple[Path, str, str]
) -> None:
    repository, first, second = versions
    settings = engine_settings(repository, first)
    socket = run_dir / "engine-0.sock"
    async with started_engine(settings, socket) as (engine, server), client_of(socket) as client:
        with pytest.raises(ConflictError, match="nothing to roll back"):
            await client.rollback()  # true: nothing came before
        await client.switch("pair", second)
        await server.close()  # the engine dies; its replacement is not there yet
        await engine.shut_down()
        await wait_until(lambda: client.status().phase == "down", timeout_s=PROMPTLY_S)
        with pytest.raises(EngineUnavailableError) as refused:
            await client.rollback()
        assert refused.value.headers["Retry-After"]
        async with started_engine(settings, socket):  # reads the record: second, after first
            await wait_until(lambda: client.status().ready, timeout_s=PROMPTLY_S)
            rolled_back = await client.rollback()
            assert rolled_back.serving.version == first
    assert read_published() == [PublishedVersion("pair", first, previous=second)]


@pytest.mark.parametrize("phase", ["down", "connecting", "loading", "failed"])
def test_a_status_that_is_not_ready_cannot_tell_a_rollback_target(phase: Phase) -> None:
    with pytest.raises(ServiceError) as refused:
        EngineStatus(phase=phase).rollback_target(None)
    assert refused.value.status_code == 503
    assert refused.value.headers["Retry-After"]


# ----------------------------------------------------------------- real processes, kill -9


@pytest.fixture
def digits_repository(tmp_path: Path) -> tuple[Path, str]:
    root = tmp_path / "models"
    copy_bundled_digits(root)
    return root, add_digits_version(root, 0.5)


def served_version(url: str) -> str | None:
    try:
        models = httpx.get(url + "/models", timeout=5.0).json()
    except (httpx.TransportError, ValueError):
        return None
    loaded = models.get("loaded")
    return str(loaded["version"]) if loaded else None


def test_an_engine_killed_during_or_after_a_switch_leaves_what_the_answer_said(
    tmp_path: Path, digits_repository: tuple[Path, str]
) -> None:
    """kill -9 of the engine at several moments of a switch: after its restart, the version
    served is the new one exactly when the switch was answered 200. A rollback asked while
    the engine restarts is 503 with ``Retry-After``, never 409."""
    root, retrained = digits_repository
    with serve_with_engines(
        tmp_path,
        1,
        BATCHSERVE_MODEL_REPOSITORY=str(root),
        BATCHSERVE_MODEL_VERSION=DIGITS.version,
        BATCHSERVE_ADMIN_TOKEN=TOKEN,
    ) as server:
        wait_until_serving(server, 1)
        for version in (retrained, DIGITS.version):  # the second switch is timed
            started_s = time.monotonic()
            switched = httpx.post(
                f"{server.url}/admin/models/digits/versions/{version}/load",
                headers=AUTH,
                timeout=60,
            )
            assert switched.status_code == 200, switched.text
            switch_s = time.monotonic() - started_s
        outcomes = []
        for fraction in (0.3, 0.6, 0.85, 1.0):
            new = DIGITS.version if served_version(server.url) == retrained else retrained
            (engine,) = engine_pids(server)
            killer = threading.Timer(switch_s * fraction, os.kill, (engine, signal.SIGKILL))
            killer.start()
            answer = httpx.post(
                f"{server.url}/admin/models/digits/versions/{new}/load", headers=AUTH, timeout=60
            )
            killer.join()
            wait_for(lambda pid=engine: not alive(pid), "the engine killed", server)
            rollback = httpx.post(f"{server.url}/admin/rollback", headers=AUTH, timeout=60)
            assert rollback.status_code == 503, rollback.text
            assert int(rollback.headers["retry-after"]) >= 1
            wait_until_serving(server, 1)
            new_served = served_version(server.url) == new
            outcomes.append((fraction, answer.status_code, new_served))
            assert answer.status_code in (200, 503), answer.text
            assert (answer.status_code == 200) == new_served, (fraction, answer.text)
        print(f"switch {switch_s:.2f} s; (fraction of it, status, new served): {outcomes}")
