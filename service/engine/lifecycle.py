"""A model version's life in an engine: load, warm up, serve, switch, retire, shut down.

``load_version`` turns a repository entry into a ``ServedModel`` (verified weights, a runner on
the device, warmed up, and a started batcher) without touching what is being served, so a
version that fails its hash check or cannot be built never replaces the one that works.
``switch_to`` then swaps it in at once and drains the old one in the background: requests
already queued on the old version finish there and say so in their answer.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

import numpy as np

from service.buckets import batch_group, manifest_length_edges
from service.config import Settings
from service.engine import published
from service.engine.batch_spans import batch_tracer
from service.engine.batching import DynamicBatcher
from service.engine.outputs import example_inputs
from service.engine.runner import TorchRunner, configure_torch_threads, resolve_device
from service.engine.state import EngineState, ServedModel
from service.errors import ConflictError, ModelIntegrityError, ModelLoadError, ModelRejectedError
from service.manifest import Manifest
from service.tensors import NamedArrays

logger = logging.getLogger(__name__)


async def load_version(state: EngineState, name: str, version: str) -> ServedModel:
    """Verify, load, place, warm up and start serving machinery for one version."""
    settings = state.settings
    loaded = await asyncio.to_thread(state.store.load, name, version)
    device = resolve_device(state.device)
    configure_torch_threads(settings.torch_threads)
    manifest = loaded.manifest
    edges = manifest_length_edges(manifest, settings.length_buckets)
    runner = await asyncio.to_thread(
        TorchRunner,
        loaded.module,
        inputs=manifest.inputs,
        outputs=manifest.outputs,
        device=device,
        precision=settings.precision,
        compile_mode=settings.compile_mode,
        max_batch_size=settings.max_batch_size,
        length_edges=edges,
    )
    batches = warmup_batches(manifest, edges, runner, settings)
    try:
        warmup_s = await asyncio.get_running_loop().run_in_executor(
            runner.executor, runner.warm_up, batches
        )
    except BaseException:
        await asyncio.to_thread(runner.close)
        raise
    batcher = DynamicBatcher[NamedArrays, NamedArrays](
        runner.run_batch,
        executor=runner.executor,
        metrics=state.metrics,
        max_batch_size=settings.max_batch_size,
        max_wait_ms=settings.max_wait_ms,
        max_queue_size=settings.max_queue_size,
        request_timeout_ms=settings.request_timeout_ms,
        max_batch_cost=settings.max_batch_tokens if edges else 0,
        policy=settings.batch_policy,
        stall_timeout_s=settings.stall_timeout_s,
        on_stall=state.report_stall,
        expected_requests=state.expected_requests,
        tracer=batch_tracer(manifest, runner),
    )
    for batch, seconds in zip(batches, warmup_s, strict=True):
        # The warm-up's timings let the deadlines be judged from the first request on.
        group, _ = batch_group(manifest, batch, edges)
        batcher.times.record(group, len(batch), seconds)
    batcher.start()
    return ServedModel(manifest=loaded.manifest, length_edges=edges, runner=runner, batcher=batcher)


def switch_to(state: EngineState, served: ServedModel) -> None:
    """Serve ``served`` from now on; retire the previous version in the background."""
    previous = state.served
    state.served = served
    replaced = None
    if previous is not None:
        old = previous.manifest
        replaced = old.label
        state.previous_version = (old.name, old.version)
        old_info = _info_labels(previous)
        # Zeroed before it is removed: with several processes the value lives on in this
        # process's metrics file, which remove() does not touch, and would still read 1.
        state.metrics.model_info.labels(*old_info).set(0)
        state.metrics.model_info.remove(*old_info)
        retiring = asyncio.get_running_loop().create_task(retire(previous))
        state.retiring.add(retiring)
        retiring.add_done_callback(state.retiring.discard)
    state.metrics.model_info.labels(*_info_labels(served)).set(1)
    manifest = served.manifest
    published.publish(
        published.PublishedVersion(manifest.name, manifest.version, state.previous_version)
    )
    freeze_long_lived_objects()
    state.changed()
    logger.info(
        "model_serving",
        extra={
            "model": manifest.name,
            "version": manifest.version,
            "replaced": replaced,
            "device": str(served.runner.device),
            "precision": served.runner.precision,
            "compile_mode": served.runner.compile_mode,
        },
    )


def _info_labels(served: ServedModel) -> tuple[str, str, str, str, str]:
    runner = served.runner
    return (
        served.manifest.name,
        served.manifest.version,
        str(runner.device),
        runner.precision,
        str(runner.compiled),
    )


async def prepare_version(state: EngineState, name: str, version: str) -> ServedModel | None:
    """Load ``name`` at ``version`` (or ``latest``) beside the serving version, warmed up.

    Returns None when that version is served already. Raises ``ModelRejectedError`` when the
    version fails its hash check or cannot be built: the serving version then stays. The
    caller holds ``state.switch_lock``.
    """
    current = state.served.manifest if state.served else None
    serving = current.label if current else "nothing"
    try:
        manifest = state.store.resolve(name, version)
        if current is not None and name != current.name:
            raise ConflictError(
                f"this server serves {current.name}, not {name}: one model per server, whose "
                "clients expect its inputs; start another server for it"
            )
        if current is not None and current.version == manifest.version:
            return None
        return await load_version(state, name, manifest.version)
    except (ModelIntegrityError, ModelLoadError) as error:
        reason = str(error).replace(str(state.store.root), "<repository>")
        raise ModelRejectedError(f"{reason}; still serving {serving}") from error


async def switch_version(
    state: EngineState, name: str, version: str
) -> tuple[Manifest, str | None]:
    """Load ``name`` at ``version`` (or ``latest``) beside the serving version, then switch.

    Returns the manifest now served and what it replaced (``name@version``), or None for what
    it replaced when that version was being served already. Raises ``ConflictError`` while
    another switch is under way, and ``ModelRejectedError`` when the version cannot be served.
    """
    if state.switch_lock.locked():
        raise ConflictError("another version is being loaded; retry when it is done")
    async with state.switch_lock:
        prepared = await prepare_version(state, name, version)
        if prepared is None:
            assert state.served is not None  # prepare_version returns None only then
            return state.served.manifest, None
        replaced = state.served.manifest.label if state.served else "nothing"
        switch_to(state, prepared)
    return prepared.manifest, replaced


async def retire(served: ServedModel) -> None:
    """Finish the requests already queued on a version, then free its device memory."""
    await served.batcher.drain()
    await asyncio.to_thread(served.runner.close)
    freeze_long_lived_objects()
    logger.info(
        "model_retired", extra={"model": served.manifest.name, "version": served.manifest.version}
    )


async def start_serving(state: EngineState, on_load_failure: Callable[[], None] | None) -> None:
    """The initial load at start-up; a failure is recorded and reported, not raised."""
    settings = state.settings
    name, version = settings.model_name, settings.model_version
    # An engine started after an admin switch (a replacement) serves what its siblings serve.
    recorded = published.read_published()
    if recorded is not None:
        name, version = recorded.name, recorded.version
    started_s = time.perf_counter()
    try:
        served = await load_version(state, name, version)
    except Exception as error:
        state.load_error = str(error)
        logger.error(
            "model_load_failed",
            extra={"model": name, "version": version, "error": str(error)},
        )
        state.changed()
        if on_load_failure is not None:
            on_load_failure()
        return
    if recorded is not None:
        state.previous_version = recorded.previous  # so that a rollback here works too
    switch_to(state, served)
    logger.info("model_ready", extra={"seconds": round(time.perf_counter() - started_s, 3)})


async def shut_down(state: EngineState, loading: asyncio.Task[None]) -> None:
    """Refuse new work, finish every queued request, stop the collectors, free the device."""
    state.draining = True
    state.changed()
    if not loading.done():
        loading.cancel()
        await asyncio.gather(loading, return_exceptions=True)
    if state.stalled:
        # The device thread is stuck in the model: draining would wait forever. Queued
        # requests have been answered 504 by their deadlines; the process must be replaced.
        logger.error("shutdown_with_stalled_model")
        return
    if state.served is not None:
        await retire(state.served)
    await asyncio.gather(*state.retiring, return_exceptions=True)
    logger.info("shutdown_complete")


def freeze_long_lived_objects() -> None:
    """Keep everything alive now (torch, the app, the served model) out of later collections.

    A full garbage collection walks every tracked object, and with torch loaded that stops the
    event loop for about 100 ms (measured: 86-142 ms, every second or so at 64 concurrent
    clients, which was the p99 under load). Requests leave short-lived objects behind, so the
    collector keeps running full passes over the long-lived heap. Frozen objects are still freed
    by reference counting; unfreezing first lets the collection find cycles in what was just
    retired. Called when the served version changes, so each pause happens then, not under load.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def warmup_batches(
    manifest: Manifest, edges: tuple[int, ...], runner: TorchRunner, settings: Settings
) -> list[NamedArrays]:
    """The batches to run before readiness, of realistic inputs (random values in the
    declared ranges, never padding; seeded, so every start warms up alike).

    Fixed shapes: every padded batch size (or ``warmup_batch_sizes``). Variable lengths: one
    row at each bucket edge up to ``max_length``, plus the largest batch the token budget
    allows at the smallest.
    """
    rng = np.random.default_rng(0)
    sizes = list(settings.warmup_batch_sizes) or runner.padded_batch_sizes
    if not edges:
        return [NamedArrays(example_inputs(manifest, size, 1, rng)) for size in sizes]
    shortest = edges[0]
    fullest = max(1, min(settings.max_batch_size, settings.max_batch_tokens // shortest))
    shapes = [(1, edge) for edge in edges] + [(fullest, shortest)]
    return [NamedArrays(example_inputs(manifest, rows, length, rng)) for rows, length in shapes]
