"""What an engine holds: the models it serves, each as a primary version and any versions
loaded beside it under a traffic split, and their machinery."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from service.bridge.interface import ModelInfo
from service.buckets import batch_group, sorted_runs
from service.config import Settings
from service.engine.batcher import DynamicBatcher, Part
from service.engine.device_turns import DeviceTurns
from service.engine.model_store import ModelStore
from service.errors import InvalidInputError
from service.manifest import Manifest, TensorSpec
from service.metrics import EngineMetrics
from service.tensors import NamedArrays
from service.types import Array

if TYPE_CHECKING:
    from service.engine.generation_loop import GenerationLoop
    from service.engine.runner import TorchRunner

#: A front end's reported load counts this long: it reports with every request, so one that
#: has been quiet longer has nothing arriving.
LOAD_FRESH_S = 0.05


class Queued(NamedTuple):
    """A request's rows as the batcher queues them: a first part (payload, group, token cost
    per row), the parts after it, and where each row of the request went (``Submission``)."""

    payload: NamedArrays
    group: Hashable
    cost_per_row: int
    more: tuple[Part, ...] = ()
    order: Sequence[int] | None = None


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

    def queued(self, instances: NamedArrays) -> Queued:
        """``instances`` as they are queued: one part of their group (``group_of``), or, for a
        request of rows of several length buckets of a model whose outputs have fixed shapes
        (an embedding, a score), its rows sorted by length into a part per bucket, each
        trimmed to its longest row (``buckets.sorted_runs``): short rows then share batches
        with short rows of any request, and are never padded to the request's longest."""
        group, cost_per_row = self.group_of(instances)
        if len(instances) < 2 or not self._sorted_by_length:
            return Queued(instances, group, cost_per_row)
        order, runs = sorted_runs(self._row_lengths(instances), self.length_edges)
        if len(runs) == 1:
            return Queued(instances, group, cost_per_row)
        parts = []
        for run in runs:
            rows = np.asarray(order[run.start : run.stop], dtype=np.intp)
            part = NamedArrays(
                {name: self._trimmed(name, array[rows], run.longest) for name, array in
                 instances.arrays.items()}
            )  # fmt: skip
            parts.append(Part(part, *self.group_of(part)))
        places = [0] * len(order)
        for place, row in enumerate(order):
            places[row] = place
        first = parts[0]
        return Queued(first.payload, first.group, first.cost_per_row, tuple(parts[1:]), places)

    @functools.cached_property
    def _sorted_by_length(self) -> bool:
        """Whether a request's rows may be queued sorted by length: the model has a variable
        input and buckets, and no output whose shape follows it (a per-token output is cut to
        its request's length, which a part of it does not have)."""
        return (
            self.manifest.variable_input is not None
            and bool(self.length_edges)
            and all(spec.variable_axis is None for spec in self.manifest.outputs)
        )

    def _row_lengths(self, instances: NamedArrays) -> list[int]:
        """Each row's own length: past its last position holding anything but padding in any
        variable-length input (the rest is padding the front end added)."""
        lengths = np.zeros(len(instances), dtype=np.int64)
        for spec in self.manifest.inputs:
            if spec.variable_axis is None:
                continue
            array = np.moveaxis(instances.arrays[spec.name], spec.variable_axis + 1, 1)
            real = (array != spec.pad_value).reshape(len(array), array.shape[1], -1).any(axis=2)
            last = array.shape[1] - np.argmax(real[:, ::-1], axis=1)
            lengths = np.maximum(lengths, np.where(real.any(axis=1), last, 0))
        return [int(length) for length in lengths]

    def _trimmed(self, name: str, array: Array, length: int) -> Array:
        """``array`` (rows of input ``name``) cut to ``length`` on its variable axis."""
        spec = self._specs[name]
        if spec.variable_axis is None:
            return array
        axis = spec.variable_axis + 1
        index = (slice(None),) * axis + (slice(0, length),)
        return np.ascontiguousarray(array[index])

    @functools.cached_property
    def _specs(self) -> dict[str, TensorSpec]:
        return {spec.name: spec for spec in self.manifest.inputs}

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

    def info(self, weight: int = 100) -> ModelInfo:
        """What a front end sees of this version; ``weight``: its share of its model's
        requests (``EngineState.weights``)."""
        return ModelInfo(
            manifest=self.manifest,
            device=str(self.runner.device),
            precision=self.runner.precision,
            compiled=self.runner.compiled,
            length_edges=self.length_edges,
            memory_bytes=self.memory_bytes,
            weight=weight,
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
    """Each model served, by name, in the order they were loaded: its primary version (the
    one its metadata describes and ``/predict`` falls back to). The first answers
    ``/predict``."""
    beside: dict[str, dict[str, ServedModel]] = field(default_factory=dict)
    """Versions of a model loaded beside its primary, by name then version: each a whole
    ``ServedModel`` (its own runner and batcher; the device's turns shared), answering the
    requests prepared for it. Absent for a model served by its primary alone."""
    weights: dict[str, dict[str, int]] = field(default_factory=dict)
    """Each model's traffic split over its loaded versions (primary included), percent
    summing to 100 (``traffic_split.py``); absent for a model served by its primary alone."""
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
    shadow_candidates: dict[str, ServedModel] = field(default_factory=dict)
    """The copy each model's shadow runs its candidate on (``engine/shadow.py``): the version
    loaded beside when it is (one copy per version, whatever uses it), else one loaded for
    the shadow alone (not served; background turns)."""
    shadow_percents: dict[str, int] = field(default_factory=dict)
    """The percent of each model's requests its shadow copies: with ``shadow_candidates``,
    what the published record keeps for an engine started later."""

    def every_version(self) -> list[ServedModel]:
        """Every version served: each model's primary, then the versions beside it."""
        return [
            *self.models.values(),
            *(served for versions in self.beside.values() for served in versions.values()),
        ]

    def every_copy(self) -> list[ServedModel]:
        """Every copy loaded, each once: those served and the shadows' own."""
        served = self.every_version()
        own = [copy for copy in self.shadow_candidates.values() if not _among(copy, served)]
        return [*served, *own]

    def beside_copy(self, name: str, version: str) -> ServedModel | None:
        """``name@version`` when it is loaded beside ``name``'s primary, else None."""
        return self.beside.get(name, {}).get(version)

    def in_use(self, copy: ServedModel) -> bool:
        """Whether ``copy`` is served or a shadow runs on it: unloaded only when it is not."""
        return _among(copy, [*self.every_version(), *self.shadow_candidates.values()])

    def weight_of(self, name: str, version: str) -> int:
        """``name@version``'s share of the requests to ``name``, percent."""
        weights = self.weights.get(name)
        return 100 if weights is None else weights.get(version, 0)

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
            for served in self.every_version()
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


def _among(copy: ServedModel, copies: Sequence[ServedModel]) -> bool:
    """Whether ``copy`` is one of ``copies`` (the same object: two loads of one version are
    two copies)."""
    return any(copy is each for each in copies)
