"""A model version's life in the server: load, warm up, serve, switch, retire, shut down.

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

from service import version_sync
from service.batching import DynamicBatcher
from service.buckets import resolve_edges
from service.config import Settings
from service.errors import ConflictError, ModelIntegrityError, ModelLoadError, ModelRejectedError
from service.inputs import InputLayout
from service.model_store import Manifest, TensorSpec
from service.runner import TorchRunner, configure_torch_threads, resolve_device
from service.state import Array, ServedModel, ServiceState

logger = logging.getLogger(__name__)

#: Longest variable length assumed when a spec gives no ``max_length`` and no buckets are set.
DEFAULT_MAX_LENGTH = 4096


async def load_version(service: ServiceState, name: str, version: str) -> ServedModel:
    """Verify, load, place, warm up and start serving machinery for one version."""
    settings = service.settings
    loaded = await asyncio.to_thread(service.store.load, name, version)
    device = resolve_device(settings.device)
    configure_torch_threads(settings.torch_threads)
    layout = input_layout(loaded.manifest.input, settings)
    runner = await asyncio.to_thread(
        TorchRunner,
        loaded.module,
        device=device,
        precision=settings.precision,
        compile_mode=settings.compile_mode,
        max_batch_size=settings.max_batch_size,
        variable_axis=layout.spec.variable_axis,
        pad_value=layout.spec.pad_value,
        length_edges=layout.length_edges,
    )
    try:
        await asyncio.get_running_loop().run_in_executor(
            runner.executor, runner.warm_up, warmup_batches(layout, runner, settings)
        )
    except BaseException:
        await asyncio.to_thread(runner.close)
        raise
    batcher = DynamicBatcher[Array, Array](
        runner.run_batch,
        executor=runner.executor,
        metrics=service.metrics,
        max_batch_size=settings.max_batch_size,
        max_wait_ms=settings.max_wait_ms,
        max_queue_size=settings.max_queue_size,
        request_timeout_ms=settings.request_timeout_ms,
        max_batch_cost=settings.max_batch_tokens if layout.length_edges else 0,
        policy=settings.batch_policy,
        stall_timeout_s=settings.stall_timeout_s,
        on_stall=service.report_stall,
    )
    batcher.start()
    return ServedModel(manifest=loaded.manifest, layout=layout, runner=runner, batcher=batcher)


def switch_to(service: ServiceState, served: ServedModel) -> None:
    """Serve ``served`` from now on; retire the previous version in the background."""
    previous = service.served
    service.served = served
    manifest, runner = served.manifest, served.runner
    settings = service.settings
    replaced = None
    if previous is not None:
        old = previous.manifest
        replaced = f"{old.name}@{old.version}"
        service.previous_version = (old.name, old.version)
        old_info = (
            old.name, old.version, str(previous.runner.device), settings.precision,
            str(previous.runner.compiled),
        )  # fmt: skip
        # Zeroed before it is removed: under gunicorn the value lives on in this worker's
        # metrics file, which remove() does not touch, and would still read 1.
        service.metrics.model_info.labels(*old_info).set(0)
        service.metrics.model_info.remove(*old_info)
        retiring = asyncio.get_running_loop().create_task(retire(previous))
        service.retiring.add(retiring)
        retiring.add_done_callback(service.retiring.discard)
    service.metrics.model_info.labels(
        manifest.name, manifest.version, str(runner.device), settings.precision,
        str(runner.compiled),
    ).set(1)  # fmt: skip
    service.metrics.ready.set(0 if service.draining else 1)
    freeze_long_lived_objects()
    logger.info(
        "model_serving",
        extra={
            "model": manifest.name,
            "version": manifest.version,
            "replaced": replaced,
            "device": str(runner.device),
            "precision": settings.precision,
            "compile_mode": settings.compile_mode,
        },
    )


async def switch_version(
    service: ServiceState, name: str, version: str
) -> tuple[Manifest, str | None]:
    """Load ``name`` at ``version`` (or ``latest``) beside the serving version, then switch.

    Returns the manifest now served and what it replaced (``name@version``), or None for what
    it replaced when that version was being served already. Raises ``ConflictError`` while
    another switch is under way, and ``ModelRejectedError`` when the version fails its hash
    check or cannot be built: the serving version then stays.
    """
    if service.switch_lock.locked():
        raise ConflictError("another version is being loaded; retry when it is done")
    async with service.switch_lock:
        current = service.manifest
        serving = f"{current.name}@{current.version}" if current else "nothing"
        manifest = service.store.resolve(name, version)
        if current is not None and (current.name, current.version) == (name, manifest.version):
            return current, None
        try:
            served = await load_version(service, name, manifest.version)
        except (ModelIntegrityError, ModelLoadError) as error:
            reason = str(error).replace(str(service.store.root), "<repository>")
            raise ModelRejectedError(f"{reason}; still serving {serving}") from error
        switch_to(service, served)
    return served.manifest, serving


async def retire(served: ServedModel) -> None:
    """Finish the requests already queued on a version, then free its device memory."""
    await served.batcher.drain()
    await asyncio.to_thread(served.runner.close)
    freeze_long_lived_objects()
    logger.info(
        "model_retired", extra={"model": served.manifest.name, "version": served.manifest.version}
    )


async def start_serving(service: ServiceState, on_load_failure: Callable[[], None] | None) -> None:
    """The initial load at start-up; a failure is recorded and reported, not raised."""
    settings = service.settings
    name, version = settings.model_name, settings.model_version
    # A worker started after an admin switch (a replacement) serves what its siblings serve.
    published = version_sync.read_published()
    if published is not None:
        name, version = published.name, published.version
    started_s = time.perf_counter()
    try:
        served = await load_version(service, name, version)
    except Exception as error:
        service.load_error = str(error)
        logger.error(
            "model_load_failed",
            extra={"model": name, "version": version, "error": str(error)},
        )
        if on_load_failure is not None:
            on_load_failure()
        return
    switch_to(service, served)
    if published is not None:
        service.previous_version = published.previous  # so that a rollback here works too
    logger.info("model_ready", extra={"seconds": round(time.perf_counter() - started_s, 3)})


async def shut_down(service: ServiceState, loading: asyncio.Task[None]) -> None:
    """Readiness off, finish every queued request, stop the collectors, free the device."""
    service.draining = True
    service.metrics.ready.set(0)
    if not loading.done():
        loading.cancel()
        await asyncio.gather(loading, return_exceptions=True)
    if service.stalled:
        # The device thread is stuck in the model: draining would wait forever. Queued
        # requests have been answered 504 by their deadlines; the process must be replaced.
        logger.error("shutdown_with_stalled_model")
        return
    if service.served is not None:
        await retire(service.served)
    await asyncio.gather(*service.retiring, return_exceptions=True)
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


def input_layout(spec: TensorSpec, settings: Settings) -> InputLayout:
    """Validation, bucketing and batch cost for the model's input (buckets only if variable)."""
    edges: tuple[int, ...] = ()
    if spec.variable_axis is not None:
        longest = spec.max_length or max(settings.length_buckets, default=DEFAULT_MAX_LENGTH)
        edges = resolve_edges(settings.length_buckets, longest)
    return InputLayout(
        spec=spec, length_edges=edges, max_instances=settings.max_instances_per_request
    )


def warmup_batches(layout: InputLayout, runner: TorchRunner, settings: Settings) -> list[Array]:
    """The batch shapes to run before readiness.

    Fixed shapes: every padded batch size (or ``warmup_batch_sizes``). Variable lengths: one
    row at each bucket edge, plus the largest batch the token budget allows at the smallest.
    """
    spec = layout.spec
    sizes = list(settings.warmup_batch_sizes) or runner.padded_batch_sizes
    if not layout.length_edges:
        return [np.repeat(spec.example_instance()[np.newaxis], size, axis=0) for size in sizes]
    shortest = layout.length_edges[0]
    fullest = max(1, min(settings.max_batch_size, settings.max_batch_tokens // shortest))
    shapes = [(1, edge) for edge in layout.length_edges] + [(fullest, shortest)]
    return [
        np.repeat(spec.example_instance(length)[np.newaxis], rows, axis=0)
        for rows, length in shapes
    ]
