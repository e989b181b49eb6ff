"""A model version's life in an engine: load, warm up, serve, switch, retire, shut down.

``load_version`` turns a repository entry into a ``ServedModel`` (verified weights, a runner on
the device, warmed up, and a started batcher) without touching what is being served, so a
version that fails its hash check or cannot be built never replaces the one that works.
``switch_to`` then swaps it in at once and drains the old one in the background: requests
already queued on the old version finish there and say so in their answer. Admin loads,
switches and unloads go through ``switching.py``, one at a time.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from service import traffic_split
from service.bridge import published
from service.bridge.interface import ENCODER_DECODER_TASK, GENERATIVE_TASKS
from service.buckets import batch_group, manifest_length_edges
from service.config import Settings
from service.engine import memory
from service.engine.batcher import DynamicBatcher, dispatch_policy
from service.engine.batcher.clock import MonotonicClock
from service.engine.batcher.run import StallWatch
from service.engine.batcher.spans import batch_tracer
from service.engine.device_turns import ModelTurns
from service.engine.generation.admission import StepLimits
from service.engine.generation_loop import GenerationLoop
from service.engine.instances import device_threads
from service.engine.outputs import example_inputs
from service.engine.runner import TorchRunner, configure_torch_threads, resolve_device
from service.engine.state import EngineState, ServedModel
from service.errors import ConflictError, ModelRejectedError
from service.manifest import Manifest
from service.tensors import NamedArrays

if TYPE_CHECKING:
    from service.engine.generation.cohorts import CohortBatch
    from service.engine.generation.continuous_batch import ContinuousBatch

logger = logging.getLogger(__name__)


async def load_version(
    state: EngineState,
    name: str,
    version: str,
    beside: Sequence[ServedModel] | None = None,
    *,
    shadow: bool = False,
) -> ServedModel:
    """Verify, load, place, warm up and start serving machinery for one version, within the
    device memory budget beside the other versions loaded (409 if it does not fit): every
    one but the primary of ``name``, which it would replace; with ``beside``, every one and
    those (loaded for a traffic split, not serving yet).

    A ``shadow`` version (``engine/shadow.py``) is counted beside every version loaded, the
    primary of its own name included; its batches run on a thread of their own, begin only
    when the device is idle (background turns) and never hold a served model back; its
    batcher's series are labelled ``<name>@shadow``."""
    settings = state.settings
    manifest = state.store.resolve(name, version)
    if shadow:
        counted = state.every_copy()
    else:
        counted = _others(state, name) if beside is None else [*state.every_copy(), *beside]
    others = [(served.manifest.label, served.memory_bytes) for served in counted]
    series = shadow_series(name) if shadow else name
    folder = state.store.version_folder(manifest.name, manifest.version)
    measured = state.measured_memory.get(manifest.label)
    memory.check_budget(
        settings.device_memory_budget_mb,
        manifest.label,
        measured if measured is not None else memory.artifact_bytes(folder, manifest),
        others,
        "measured at its last load" if measured is not None else "the size of its artifact",
    )
    device = resolve_device(state.device)
    threads = configure_torch_threads(settings.torch_threads)
    if state.device_thread is None:
        state.device_thread = device_threads(settings.device_instances, threads)
    executor = device_threads(1, threads) if shadow else state.device_thread
    instances = 1 if shadow else settings.device_instances
    memory.release_freed_memory(device)  # so that what others freed is not counted as ours
    before_bytes = memory.memory_in_use(device)
    loaded = await asyncio.to_thread(state.store.load, name, manifest.version)
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
        executor=executor,
    )
    language_model = getattr(loaded.module, "language_model", None)
    del loaded
    batches = warmup_batches(manifest, edges, runner, settings)
    turns = state.device_turns.for_model(series, background=shadow)
    continuous: ContinuousBatch | CohortBatch | None = None
    try:
        warmup_s = await _warm_up(runner, batches, turns)
        if manifest.metadata.get("task") in GENERATIVE_TASKS:
            taken = memory.memory_in_use(device) - before_bytes
            budget = kv_cache_budget(settings, taken, sum(size for _, size in others))
            continuous = await _continuous_batch(
                state.settings, runner, turns, language_model, manifest, budget
            )
        memory.release_freed_memory(device)  # the loading's scratch copies are not kept
        memory_bytes = memory.taken_since(device, before_bytes, folder, manifest)
        state.measured_memory[manifest.label] = memory_bytes
        memory.check_budget(
            settings.device_memory_budget_mb,
            manifest.label,
            memory_bytes,
            others,
            "measured after its warm-up",
        )
    except BaseException:
        await asyncio.to_thread(runner.close)
        memory.release_freed_memory(device)
        raise
    metrics = state.metrics.for_model(series, manifest.version)
    runner.count_positions = metrics.batch_positions  # warmed up: requests' batches from now
    batcher = DynamicBatcher[NamedArrays, NamedArrays](
        runner.run_batch,
        policy=dispatch_policy(
            settings.batch_policy,
            settings.max_wait_ms,
            expected_requests=state.expected_requests,
            instances=instances,
        ),
        executor=runner.executor,
        metrics=metrics,
        max_batch_size=settings.max_batch_size,
        max_queue_size=settings.max_queue_size,
        request_timeout_ms=settings.request_timeout_ms,
        max_batch_cost=settings.max_batch_tokens if edges else 0,
        max_batch_ms=settings.max_batch_ms,
        max_run_ms=settings.max_run_ms,
        quantum_floor_cost=max((batch_group(manifest, b, edges)[1] for b in batches), default=0),
        stall_timeout_s=settings.stall_timeout_s,
        on_stall=state.report_stall,
        tracer=batch_tracer(manifest, runner),
        instances=instances,
        turns=turns,
    )
    for batch, seconds in zip(batches, warmup_s, strict=True):
        # The warm-up's timings let the deadlines be judged from the first request on.
        group, _ = batch_group(manifest, batch, edges)
        batcher.times.record(group, len(batch), seconds)
    batcher.start()
    generation = None
    if continuous is not None:
        generation = GenerationLoop(
            continuous,
            model=manifest.name,
            version=manifest.version,
            executor=runner.executor,
            turns=turns,
            metrics=state.metrics,
            stall=StallWatch(MonotonicClock(), settings.stall_timeout_s, state.report_stall),
        )
        generation.start()
    return ServedModel(
        manifest=manifest,
        length_edges=edges,
        runner=runner,
        batcher=batcher,
        memory_bytes=memory_bytes,
        generation=generation,
    )


def kv_cache_budget(settings: Settings, taken_bytes: int, others_bytes: int) -> int:
    """Bytes for a generative version's KV cache: ``kv_cache_mb``, and no more than the
    device memory budget leaves beside the other models and this one's weights."""
    budget = settings.kv_cache_mb * memory.MIB
    if settings.device_memory_budget_mb > 0:
        left = settings.device_memory_budget_mb * memory.MIB - others_bytes - max(0, taken_bytes)
        budget = min(budget, max(0, left))
    return budget


async def _continuous_batch(
    settings: Settings,
    runner: TorchRunner,
    turns: ModelTurns,
    model: Any,
    manifest: Manifest,
    kv_budget_bytes: int,
) -> ContinuousBatch | CohortBatch:
    """The version's continuous batch, built on the device thread (it probes the model's KV
    layout with a forward) in a turn of its model's; 409 when its KV cache would not hold one
    sequence."""
    from service.engine.generation.cohorts import CohortBatch
    from service.engine.generation.continuous_batch import ContinuousBatch

    if model is None:
        raise ModelRejectedError(
            f"{manifest.label} is a {manifest.metadata.get('task')} version whose architecture "
            "has no language model to generate with (package it with --hf)"
        )
    limits = StepLimits(
        max_running_sequences=settings.max_running_sequences,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
    )

    def build() -> ContinuousBatch | CohortBatch:
        if manifest.metadata.get("task") == ENCODER_DECODER_TASK:
            metadata = manifest.metadata
            return CohortBatch(
                model,
                max_running_sequences=settings.max_running_sequences,
                max_waiting_sequences=settings.max_waiting_sequences,
                eos_token_ids=metadata.get("eos_token_ids") or (),
                decoder_start_token_id=metadata.get("decoder_start_token_id"),
                context_tokens=metadata.get("context_tokens"),
                kv_budget_bytes=kv_budget_bytes,
                forced_bos_token_id=metadata.get("forced_bos_token_id"),
                forced_eos_token_ids=metadata.get("forced_eos_token_ids") or (),
                precision=settings.precision,
            )
        return ContinuousBatch(
            model,
            kv_budget_bytes=kv_budget_bytes,
            limits=limits,
            max_waiting_sequences=settings.max_waiting_sequences,
            eos_token_ids=manifest.metadata.get("eos_token_ids") or (),
            precision=settings.precision,
        )

    async with turns.turn():
        try:
            return await asyncio.get_running_loop().run_in_executor(runner.executor, build)
        except ValueError as error:
            raise ConflictError(
                f"{manifest.label} cannot generate: {error} (BATCHSERVE_KV_CACHE_MB, "
                "BATCHSERVE_DEVICE_MEMORY_BUDGET_MB)"
            ) from error


async def _warm_up(
    runner: TorchRunner, batches: list[NamedArrays], turns: ModelTurns
) -> list[float]:
    """Each warm-up batch on the device thread in a turn of its model's, so that the models
    already served take turns with them rather than wait for the whole warm-up."""
    loop = asyncio.get_running_loop()
    started_s = time.perf_counter()
    seconds = []
    for index, batch in enumerate(batches):
        async with turns.turn():
            if index == 0:
                await loop.run_in_executor(runner.executor, runner.check_outputs, batch)
            seconds.append(await loop.run_in_executor(runner.executor, runner.warm_up_batch, batch))
    logger.info(
        "model_warmed_up",
        extra={"batches": len(batches), "seconds": round(time.perf_counter() - started_s, 3)},
    )
    return seconds


def shadow_series(name: str) -> str:
    """The name a shadow of ``name`` takes its device turns and batch series under."""
    return f"{name}@shadow"


def _others(state: EngineState, name: str) -> list[ServedModel]:
    """Every copy loaded but the primary of ``name`` (which a new one would replace)."""
    primary = state.models.get(name)
    return [served for served in state.every_copy() if served is not primary]


def switch_to(state: EngineState, served: ServedModel) -> str:
    """Serve ``served`` from now on, beside the other models or in place of the version of
    its name served now, which retires in the background, as do the versions loaded beside
    it (a switch ends a traffic split); publish that. Returns what it replaced:
    ``name@version``, or ``nothing``."""
    manifest = served.manifest
    previous = state.models.get(manifest.name)
    state.models[manifest.name] = served
    state.weights.pop(manifest.name, None)
    for candidate in state.beside.pop(manifest.name, {}).values():
        _retire_unused_in_background(state, candidate)  # not the one promoted, nor a shadow's
    replaced = "nothing"
    if previous is not None:
        replaced = previous.manifest.label
        state.previous_versions[manifest.name] = previous.manifest.version
        _retire_unused_in_background(state, previous)
    state.metrics.model_info.labels(*_info_labels(served)).set(1)
    state.metrics.model_memory.labels(*_memory_labels(served)).set(served.memory_bytes)
    publish(state)
    freeze_long_lived_objects(retired=False)  # what it replaces is retired in the background
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
            "memory_bytes": served.memory_bytes,
        },
    )
    return replaced


def split_traffic(
    state: EngineState, name: str, weights: dict[str, int], loaded: dict[str, ServedModel]
) -> str | None:
    """Serve ``name`` by ``weights`` (checked: ``traffic_split.checked_weights``) from now on,
    over its versions loaded already and ``loaded`` (just loaded for it); publish that. The
    version with the most weight is the primary; versions the weights leave out retire in the
    background. Returns the ``name@version`` of the primary it replaced, or None."""
    current = state.models[name]
    versions = {current.manifest.version: current, **state.beside.get(name, {}), **loaded}
    primary_version = traffic_split.primary_of(weights, current.manifest.version)
    kept = {version: versions[version] for version in weights}
    primary = kept.pop(primary_version)
    state.models[name] = primary
    state.beside.pop(name, None)
    state.weights.pop(name, None)
    if kept:
        state.beside[name] = kept
        state.weights[name] = dict(weights)
    for version, served in versions.items():
        if version not in weights:
            _retire_unused_in_background(state, served)  # a shadow may still run on it
    replaced = None
    if primary is not current:
        replaced = current.manifest.label
        state.previous_versions[name] = current.manifest.version
    for served in loaded.values():
        if served.manifest.version in weights:
            state.metrics.model_info.labels(*_info_labels(served)).set(1)
            state.metrics.model_memory.labels(*_memory_labels(served)).set(served.memory_bytes)
    publish(state)
    freeze_long_lived_objects(retired=False)
    state.changed()
    logger.info(
        "traffic_split",
        extra={"model": name, "weights": dict(weights), "primary": primary_version},
    )
    return replaced


def _retire_unused_in_background(state: EngineState, served: ServedModel) -> None:
    """Retire ``served`` unless it is still served or a shadow runs on it."""
    if state.in_use(served):
        return
    _forget_series(state, served)
    retiring = asyncio.get_running_loop().create_task(_retire_served(state, served))
    state.retiring.add(retiring)
    retiring.add_done_callback(state.retiring.discard)


def _forget_series(state: EngineState, served: ServedModel) -> None:
    """Zeroed before removed: with several processes the value lives on in this process's
    metrics file, which remove() does not touch, and would still read 1."""
    for gauge, labels in (
        (state.metrics.model_info, _info_labels(served)),
        (state.metrics.model_memory, _memory_labels(served)),
    ):
        gauge.labels(*labels).set(0)
        gauge.remove(*labels)


def publish(state: EngineState) -> None:
    """Record what is served now, each model's split and shadow (``bridge/published.py``)."""
    published.publish(
        [
            published.PublishedVersion(
                name,
                served.manifest.version,
                state.previous_versions.get(name),
                dict(state.weights.get(name, {})),
                _shadow_of(state, name),
            )
            for name, served in state.models.items()
        ]
    )


def _shadow_of(state: EngineState, name: str) -> tuple[str, int] | None:
    candidate = state.shadow_candidates.get(name)
    percent = state.shadow_percents.get(name)
    if candidate is None or percent is None:
        return None
    return candidate.manifest.version, percent


def _info_labels(served: ServedModel) -> tuple[str, str, str, str, str]:
    runner = served.runner
    return (
        served.manifest.name,
        served.manifest.version,
        str(runner.device),
        runner.precision,
        str(runner.compiled),
    )


def _memory_labels(served: ServedModel) -> tuple[str, str, str]:
    return served.manifest.name, served.manifest.version, str(served.runner.device)


async def withdraw(state: EngineState, name: str) -> None:
    """Stop serving ``name`` (new requests for it are refused from now on), publish that,
    finish its queued requests and free its memory. The caller holds ``state.switch_lock``."""
    served = state.models.pop(name)
    candidates = list(state.beside.pop(name, {}).values())
    state.weights.pop(name, None)
    state.previous_versions.pop(name, None)
    for each in (served, *candidates):
        _forget_series(state, each)
    publish(state)
    state.changed()
    await asyncio.gather(*(_retire_served(state, each) for each in (served, *candidates)))
    state.device_turns.forget(name)


async def retire_unused(state: EngineState, copy: ServedModel) -> None:
    """Unload ``copy`` unless it is still served or a shadow runs on it: a copy the shadow
    loaded for itself with its own thread and turns, a version served once as any other."""
    if state.in_use(copy):
        return
    if copy.runner.executor is state.device_thread:
        _forget_series(state, copy)
        await _retire_served(state, copy)
    else:
        await retire_shadow(state, copy)


async def release_shadow_copy(state: EngineState, name: str, version: str) -> None:
    """Unload the copy of ``name@version`` a shadow loaded for itself (background turns, its
    own thread), so that the version about to be loaded to serve is its one copy; the shadow
    runs on the served copy once it is committed (``Engine``)."""
    copy = state.shadow_candidates.get(name)
    if copy is None or copy.manifest.version != version:
        return
    if any(copy is served for served in state.every_version()):
        return  # the served copy already
    del state.shadow_candidates[name]
    await retire_shadow(state, copy)


async def _retire_served(state: EngineState, served: ServedModel) -> None:
    """``retire`` a version that was served, then drop its batcher's gauges (its queue is
    empty by then, and nothing sets them again)."""
    await retire(served)
    state.metrics.forget_version(served.manifest.name, served.manifest.version)


async def retire_shadow(state: EngineState, candidate: ServedModel) -> None:
    """Unload a shadow candidate once its queued copies have run; forget its turns."""
    await retire(candidate)
    state.metrics.forget_version(shadow_series(candidate.manifest.name), candidate.manifest.version)
    candidate.runner.executor.shutdown(wait=False)  # its own thread, idle once retired
    state.device_turns.forget(shadow_series(candidate.manifest.name))


async def retire(served: ServedModel) -> None:
    """Finish the requests already queued on a version, and its streams, then free its
    device memory."""
    if served.generation is not None:
        await asyncio.gather(served.batcher.drain(), served.generation.drain())
    else:
        await served.batcher.drain()
    await asyncio.to_thread(served.runner.close)
    freeze_long_lived_objects(retired=True)
    memory.release_freed_memory(served.runner.device)
    logger.info(
        "model_retired", extra={"model": served.manifest.name, "version": served.manifest.version}
    )


async def start_serving(state: EngineState, on_load_failure: Callable[[], None] | None) -> None:
    """The initial loads at start-up, in order; a failure is recorded and reported, not
    raised, and the models loaded before it are served no more."""
    wanted = state.settings.served_models()
    # An engine started after an admin switch (a replacement) serves what its siblings serve.
    recorded = published.read_published()
    splits: dict[str, dict[str, int]] = {}
    if recorded is not None:
        wanted = [(entry.name, entry.version) for entry in recorded]
        splits = {entry.name: entry.weights for entry in recorded if entry.weights}
    started_s = time.perf_counter()
    for name, version in wanted:
        try:
            async with state.switch_lock:
                served = await load_version(state, name, version)
                switch_to(state, served)
                if name in splits:  # and the versions its split served beside it
                    loaded = await load_missing_versions(state, name, splits[name])
                    split_traffic(state, name, splits[name], loaded)
        except Exception as error:
            state.load_error = f"{name}@{version}: {error}"
            logger.error(
                "model_load_failed",
                extra={"model": name, "version": version, "error": str(error)},
            )
            state.changed()
            if on_load_failure is not None:
                on_load_failure()
            return
    for entry in recorded or ():
        if entry.previous is not None:  # so that a rollback here works too
            state.previous_versions[entry.name] = entry.previous
    state.loaded = True
    state.changed()
    logger.info(
        "model_ready",
        extra={"models": list(state.models), "seconds": round(time.perf_counter() - started_s, 3)},
    )


async def load_missing_versions(
    state: EngineState, name: str, weights: dict[str, int]
) -> dict[str, ServedModel]:
    """The versions of ``weights`` that ``name`` (served) has not loaded, loaded and warmed up
    beside every version loaded, by id; all or none (a failure retires those loaded before
    it, and is raised)."""
    current = state.models[name]
    loaded_already = {current.manifest.version, *state.beside.get(name, {})}
    loaded: dict[str, ServedModel] = {}
    try:
        for version in weights:
            if version not in loaded_already:
                await release_shadow_copy(state, name, version)
                loaded[version] = await load_version(state, name, version, list(loaded.values()))
    except BaseException:
        await asyncio.gather(*(retire(served) for served in loaded.values()))
        raise
    return loaded


async def shut_down(state: EngineState, loading: asyncio.Task[None]) -> None:
    """Refuse new work, finish every queued request, stop the collectors, free the device."""
    state.draining = True
    state.changed()
    if not loading.done():
        loading.cancel()
        await asyncio.gather(loading, return_exceptions=True)
    if state.stalled:
        # The device thread is stuck in a model: draining would wait forever. Queued
        # requests have been answered 504 by their deadlines; the process must be replaced.
        logger.error("shutdown_with_stalled_model")
        return
    await asyncio.gather(*(retire(served) for served in state.every_version()))
    await asyncio.gather(*state.retiring, return_exceptions=True)
    if state.device_thread is not None:
        state.device_thread.shutdown(wait=True)
    logger.info("shutdown_complete")


def freeze_long_lived_objects(*, retired: bool) -> None:
    """Keep everything alive now (torch, the app, the served model) out of later collections.

    A full garbage collection walks every tracked object, and with torch loaded that stops the
    event loop long enough to be the p99 under load. Frozen objects are still freed by
    reference counting. Called when the served version changes, so each pause happens then,
    not under load.

    ``retired``: a version was just let go of, so the whole heap is unfrozen and searched for
    its cycles. Otherwise (a version starts serving) only what was made since the last freeze
    is: a walk of torch's objects would slow a restart, with nothing retired to find.
    """
    if retired:
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
