"""What the routes need of the running service, in one object kept on ``app.state``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from service.batching import DynamicBatcher
from service.config import Settings
from service.inputs import InputLayout
from service.metrics import ServiceMetrics, resident_memory_bytes
from service.model_store import Manifest, ModelStore

if TYPE_CHECKING:
    from service.runner import TorchRunner

Array = npt.NDArray[np.generic]


@dataclass(frozen=True)
class ServedModel:
    """One loaded version and the machinery serving it, swapped in and out as a whole so a
    request always sees a manifest, input layout and batcher that belong together."""

    manifest: Manifest
    layout: InputLayout
    runner: TorchRunner
    batcher: DynamicBatcher[Array, Array]


@dataclass
class ServiceState:
    """Filled in by ``lifecycle.py`` as versions load and switch; read by the routes."""

    settings: Settings
    metrics: ServiceMetrics
    store: ModelStore
    served: ServedModel | None = None
    previous_version: tuple[str, str] | None = None
    """(name, version) served before the last switch: what ``/admin/rollback`` goes back to."""
    draining: bool = False
    load_error: str | None = None
    switch_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while an admin load is under way; a second one is refused (409)."""
    retiring: set[asyncio.Task[None]] = field(default_factory=set)
    """Versions switched away from, still finishing their queued requests."""
    on_stall: Callable[[], None] | None = None
    """Called once when a batch outlives ``stall_timeout_s`` (the CLI stops the server)."""

    def refresh_memory_gauges(self) -> None:
        """This process's resident memory and its device's memory, into their gauges."""
        self.metrics.resident_memory.set(resident_memory_bytes())
        runner = self.runner
        if runner is not None:
            allocated, reserved = runner.device_memory_bytes()
            device = str(runner.device)
            self.metrics.device_memory_allocated.labels(device).set(allocated)
            self.metrics.device_memory_reserved.labels(device).set(reserved)

    def report_stall(self) -> None:
        """The model looks hung: readiness off, then let the owner of the process react."""
        self.metrics.ready.set(0)
        if self.on_stall is not None:
            self.on_stall()

    @property
    def manifest(self) -> Manifest | None:
        return self.served.manifest if self.served else None

    @property
    def layout(self) -> InputLayout | None:
        return self.served.layout if self.served else None

    @property
    def runner(self) -> TorchRunner | None:
        return self.served.runner if self.served else None

    @property
    def batcher(self) -> DynamicBatcher[Array, Array] | None:
        return self.served.batcher if self.served else None

    @property
    def stalled(self) -> bool:
        """A batch has outlived ``stall_timeout_s``: the model looks hung."""
        return self.served is not None and self.served.batcher.stalled

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    @property
    def phase(self) -> str:
        """loading, ready, draining, stalled or failed."""
        if self.load_error is not None:
            return "failed"
        if self.stalled:
            return "stalled"
        if self.draining:
            return "draining"
        return "ready" if self.served is not None else "loading"
