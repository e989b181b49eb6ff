"""What a front end's routes need: settings, metrics, the engines, and whether it drains."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from service.bridge.interface import EngineClient, ModelInfo
from service.config import Settings
from service.frontend.inputs import InputLayout
from service.metrics import FrontendMetrics, ProcessMetrics
from service.repository import ModelRepository

#: Input layouts a front end keeps, one per version it has validated requests for.
_LAYOUT_CACHE_SIZE = 8


@dataclass
class FrontendState:
    """Kept on ``app.state.frontend``; the engines are behind ``engine`` (in this process or
    behind the bridge), so nothing here knows where the model runs."""

    settings: Settings
    metrics: FrontendMetrics
    process_metrics: ProcessMetrics
    registry: CollectorRegistry
    """Where this process's metrics live (rendered alone, or with every process's)."""
    engine: EngineClient
    repository: ModelRepository
    engine_in_process: bool
    """One process serving alone: a hung model means this process must be replaced. Behind
    the bridge the supervisor replaces the engine and the front end stays alive."""
    draining: bool = False
    holding: int = 0
    """Requests whose body has been read and that are not answered yet."""
    receiving: int = 0
    """Prediction requests in this front end, from their first byte to their answer."""
    gauge_refreshers: list[Callable[[], None]] = field(default_factory=list)
    """More gauges to refresh with this process's (an engine in this process adds its own)."""
    _layouts: dict[str, InputLayout] = field(default_factory=dict)

    @property
    def phase(self) -> str:
        """This front end's readiness: draining, or the state of the engines it reaches."""
        return "draining" if self.draining else self.engine.status().phase

    @property
    def ready(self) -> bool:
        return not self.draining and self.engine.status().ready

    def serving_model(self) -> ModelInfo:
        """The model requests are validated against now; 503 when none can take them."""
        status = self.engine.status()  # draining: readiness is off, but requests are served
        if status.ready and status.model is not None:
            return status.model
        raise status.refusal()

    def layout_for(self, model: ModelInfo) -> InputLayout:
        """How requests for ``model`` are parsed, validated and grouped (built once a version)."""
        key = model.manifest.version
        layout = self._layouts.get(key)
        if layout is None:
            layout = InputLayout(
                spec=model.manifest.input,
                length_edges=model.length_edges,
                max_instances=self.settings.max_instances_per_request,
            )
            if len(self._layouts) >= _LAYOUT_CACHE_SIZE:
                del self._layouts[next(iter(self._layouts))]
            self._layouts[key] = layout
        return layout

    def refresh_gauges(self) -> None:
        """Readiness, the engines reached and this process's memory, into their gauges."""
        self.metrics.ready.set(1 if self.ready else 0)
        self.metrics.engines_ready.set(sum(engine.ready for engine in self.engine.engines()))
        self.process_metrics.refresh()
        for refresh in self.gauge_refreshers:
            refresh()
