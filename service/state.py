"""What the routes need of the running service, in one object kept on ``app.state``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from service.batching import DynamicBatcher
from service.config import Settings
from service.inputs import InputLayout
from service.metrics import ServiceMetrics
from service.model_store import Manifest, ModelStore

if TYPE_CHECKING:
    from service.runner import TorchRunner

Array = npt.NDArray[np.generic]


@dataclass
class ServiceState:
    """Filled in by ``app.py`` as the model loads; read by the routes."""

    settings: Settings
    metrics: ServiceMetrics
    store: ModelStore
    manifest: Manifest | None = None
    layout: InputLayout | None = None
    runner: TorchRunner | None = None
    batcher: DynamicBatcher[Array, Array] | None = None
    draining: bool = False
    load_error: str | None = field(default=None)

    @property
    def stalled(self) -> bool:
        """A batch has outlived ``stall_timeout_s``: the model looks hung."""
        return self.batcher is not None and self.batcher.stalled

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
        return "ready" if self.batcher is not None else "loading"
