"""What an engine holds: the models it serves, each one version at a time, and their machinery."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.bridge.interface import ModelInfo
from service.buckets import batch_group
from service.config import Settings
from service.engine.batcher import DynamicBatcher
from service.engine.device_turns import DeviceTurns
from service.engine.model_store import ModelStore
from service.errors import InvalidInputError
from service.manifest import Manifest, TensorSpec
from service.metrics import EngineMetrics
from service.tensors import NamedArrays

if TYPE_CHECKING:
    from service.engine.generation_loop import GenerationLoop
    from service.engine.runner import TorchRunner

#: A front end's reported load counts this long: it reports with every request, so one that
#: has been quiet longer has nothing arriving.
LOAD_FRESH_S = 0.05


@dataclass(frozen=True)
class ServedModel:
    """One loaded version and the machinery serving it, swapped in and out as a whole so a
    request always meets a manifest, runner and batcher that belong together."""

    manifest: Manifest
    length_edges: tuple[int, ...]
    runner: TorchRunner
    batcher: DynamicBatcher[NamedArrays, NamedArrays]
    memory_bytes: int
    """What loading and warming it up took on the device (see ``memory.py``), its KV cache
    included."""
    generation: GenerationLoop | None = None
    """A generative version's loop (``EngineClient.generate``); None for the others."""

    def group_of(self, instances: NamedArrays) -> tuple[tuple[int, ...], int]:
        """The batch group and token cost per row of ``instances``, computed here from their
        shapes: which requests may share a batch is the engine's to decide, not a front
        end's to claim (a wrong group would put unequal shapes in one batch)."""
        fixed = self._fixed_shape_input
        try:
            if fixed is not None:  # fixed shapes: the shape is the group
                return instances.arrays[fixed].shape[1:], 0
            return batch_group(self.manifest, instances, self.length_edges)
        except (KeyError, ValueError, IndexError) as error:
            raise InvalidInputError(
                f"the instances do not fit {self.manifest.label}'s inputs: {error}"
            ) from error

    @functools.cached_property
    def _fixed_shape_input(self) -> str | None:
        """The grouping input's name when its shape is fixed (its shape is then the group),
        else None."""
        spec = self._grouping_input
        return spec.name if spec.variable_axis is None else None

    @functools.cached_property
    def _grouping_input(self) -> TensorSpec:
        """The input whose shape decides the group (``buckets.batch_group``)."""
        return self.manifest.variable_input or self.manifest.input

    def info(self) -> ModelInfo:
        return ModelInfo(
            manifest=self.manifest,
            device=str(self.runner.device),
            precision=self.runner.precision,
            compiled=self.runner.compiled,
            length_edges=self.length_edges,
            memory_bytes=self.memory_bytes,
        )


@dataclass
class EngineState:
    """Filled in by ``lifecycle.py`` as models load, switch and unload; read by ``Engine``."""

    settings: Settings
    metrics: EngineMetrics
    store: ModelStore
    device: str
    """This engine's ``device`` setting: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    device_thread: ThreadPoolExecutor | None = None
    """The device's threads (``instances.py``: one per model instance, one by default) that
    run every model's batches and warm-ups, as ``device_turns`` hands the device out; made
    at the first load, once torch's thread count is set."""
    device_turns: DeviceTurns = field(default_factory=DeviceTurns)
    """Which model runs next on the device: the one that has used it least."""
    models: dict[str, ServedModel] = field(default_factory=dict)
    """Each model served, by name, in the order they were loaded: the first answers
    ``/predict``."""
    previous_versions: dict[str, str] = field(default_factory=dict)
    """Each model's version served before its last switch: what a rollback goes back to."""
    measured_memory: dict[str, int] = field(default_factory=dict)
    """What each ``name@version`` took when last loaded here: the budget's estimate for it."""
    loaded: bool = False
    """Every model to serve at start has been loaded: ready only from then on."""
    draining: bool = False
    load_error: str | None = None
    switch_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held from the start of a load, switch or unload to its end; a second is refused (409).
    One at a time also keeps each model's memory measurement its own."""
    retiring: set[asyncio.Task[None]] = field(default_factory=set)
    """Versions switched away from or unloaded, still finishing their queued requests."""
    listeners: list[Callable[[], None]] = field(default_factory=list)
    """Called whenever the state a front end sees changes (``Engine.status``)."""
    on_stall: Callable[[], None] | None = None
    """Called once when a batch outlives ``stall_timeout_s`` (the owner stops the process)."""
    frontend_loads: dict[Hashable, tuple[int, float]] = field(default_factory=dict)
    """Each front end's last reported load (``InferenceRequest.frontend_load``) and when."""

    @property
    def served(self) -> ServedModel | None:
        """The first model: the one ``/predict`` answers with."""
        return next(iter(self.models.values()), None)

    def expected_requests(self) -> int:
        """Requests the front ends hold now, as they last said within ``LOAD_FRESH_S``:
        what the adaptive policy may wait for. An idle front end's word goes stale."""
        fresh_after_s = time.monotonic() - LOAD_FRESH_S
        return sum(load for load, at_s in self.frontend_loads.values() if at_s >= fresh_after_s)

    def changed(self) -> None:
        for listener in list(self.listeners):
            listener()

    def refresh_device_memory(self) -> None:
        """The device's memory, into its gauges (0 on CPU)."""
        served = self.served
        if served is not None:
            allocated, reserved = served.runner.device_memory_bytes()
            device = str(served.runner.device)
            self.metrics.device_memory_allocated.labels(device).set(allocated)
            self.metrics.device_memory_reserved.labels(device).set(reserved)

    def report_stall(self) -> None:
        """The model looks hung: tell the front ends, then let the owner of the process react."""
        self.changed()
        if self.on_stall is not None:
            self.on_stall()

    @property
    def stalled(self) -> bool:
        """A batch or a generation step has outlived ``stall_timeout_s``: a model looks hung,
        and with it the device thread every model shares."""
        return any(
            served.batcher.stalled or (served.generation is not None and served.generation.stalled)
            for served in self.models.values()
        )

    @property
    def phase(self) -> str:
        """loading, ready, draining, stalled or failed."""
        if self.load_error is not None:
            return "failed"
        if self.stalled:
            return "stalled"
        if self.draining:
            return "draining"
        return "ready" if self.loaded and self.models else "loading"
