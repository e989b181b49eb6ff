"""What a front end's routes need: settings, metrics, the engines, and whether it drains."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from prometheus_client import CollectorRegistry

from service import traffic_split
from service.bridge.interface import EngineClient, ModelInfo
from service.bridge.published import RolloutRecords
from service.config import Settings
from service.errors import HandlerError, ModelNotFoundError
from service.frontend.generation.text_model import TextModel, load_text_model
from service.frontend.handlers.base import Handler, HandlerContext, build_handler
from service.frontend.inputs import InputLayout
from service.frontend.preprocessing import handler_thread_count
from service.frontend.refusal_hold import RefusalHolds
from service.frontend.request_metrics import RequestTally
from service.frontend.response_cache import ResponseCache
from service.frontend.routing import Routing
from service.metrics import FrontendMetrics, ProcessMetrics
from service.repository import ModelRepository
from service.types import Priority

logger = logging.getLogger(__name__)

#: Input layouts and handlers a front end keeps, one per version it has served requests for.
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
    rollouts: RolloutRecords = field(default_factory=RolloutRecords.of_run)
    """Each model's rollout plan, as ``batchserve rollout`` recorded it."""
    holding: int = 0
    """Requests whose body has been read and that are not answered yet."""
    receiving: int = 0
    """Prediction requests in this front end, from their first byte to their answer."""
    gauge_refreshers: list[Callable[[], None]] = field(default_factory=list)
    """More gauges to refresh with this process's (an engine in this process adds its own)."""
    request_tally: RequestTally = field(init=False)
    """Request counts, latencies and in-flight, written to ``metrics`` a batch at a time."""
    refusal_holds: RefusalHolds = field(init=False)
    """When each HTTP client refused for load may retry."""
    response_cache: ResponseCache | None = field(init=False)
    """Engine answers kept by content (``response_cache_mb``); None when off."""
    _layouts: dict[str, InputLayout] = field(default_factory=dict)
    _handlers: dict[str, Handler] = field(default_factory=dict)
    _text_models: dict[str, TextModel] = field(default_factory=dict)
    _handler_pool: ThreadPoolExecutor | None = None

    @classmethod
    def over(
        cls,
        engine: EngineClient,
        settings: Settings,
        *,
        engine_in_process: bool = False,
        registry: CollectorRegistry | None = None,
        metrics: FrontendMetrics | None = None,
        repository: ModelRepository | None = None,
        gauge_refreshers: Sequence[Callable[[], None]] = (),
    ) -> FrontendState:
        """A front end over ``engine``: its metrics in ``registry`` (a new one unless given;
        ``metrics`` when already made there), this process counted as the server when the
        engine runs in it and as a front end otherwise, and ``settings``' model repository
        unless another is given."""
        registry = CollectorRegistry() if registry is None else registry
        return cls(
            settings=settings,
            metrics=FrontendMetrics(registry) if metrics is None else metrics,
            process_metrics=ProcessMetrics("server" if engine_in_process else "frontend", registry),
            registry=registry,
            engine=engine,
            repository=(
                ModelRepository(settings.model_repository) if repository is None else repository
            ),
            engine_in_process=engine_in_process,
            gauge_refreshers=list(gauge_refreshers),
        )

    def __post_init__(self) -> None:
        self.request_tally = RequestTally(self.metrics)
        self.refusal_holds = RefusalHolds(self.settings.refusal_hold_ms)
        self.response_cache = ResponseCache.from_settings(self.settings, self.metrics)

    @property
    def handler_pool(self) -> ThreadPoolExecutor:
        """Where handlers' preprocessing runs, off the event loop (``handler_threads``).
        Started on first use, in the process that serves (after gunicorn's fork)."""
        if self._handler_pool is None:
            self._handler_pool = ThreadPoolExecutor(
                handler_thread_count(self.settings.handler_threads),
                thread_name_prefix="batchserve-handler",
            )
        return self._handler_pool

    @property
    def phase(self) -> str:
        """This front end's readiness: draining, or the state of the engines it reaches."""
        return "draining" if self.draining else self.engine.status().phase

    @property
    def ready(self) -> bool:
        return not self.draining and self.engine.status().ready

    def serving_model(
        self, name: str | None = None, version: str | None = None, routing: Routing | None = None
    ) -> ModelInfo:
        """The model ``name`` (the first served when None) that requests are validated against
        now: its primary version, or ``version`` when one is named and loaded (the primary or
        beside it); with ``routing`` (an inference request's) and no ``version``, the version
        its traffic split gives the request, remembered in ``routing.chosen``. 503 when no
        engine can take requests, 404 for a model or version not served."""
        status = self.engine.status()  # draining: readiness is off, but requests are served
        if not status.ready or status.model is None:
            raise status.refusal()
        model = status.model if name is None else status.find(name)
        if model is None:
            served = ", ".join(repr(model.manifest.name) for model in status.models)
            raise ModelNotFoundError(f"unknown model {name!r}: this server serves {served}")
        if version:  # named: that version exactly, the primary or one beside it
            if version != model.manifest.version:
                loaded = status.find_version(model.manifest.name, version)
                if loaded is None:
                    serving = ", ".join(status.weights(model.manifest.name))
                    raise ModelNotFoundError(
                        f"{model.manifest.name} version {version!r} is not served (serving "
                        f"{serving}); load it first"
                    )
                model = loaded
        elif routing is not None and status.beside and status.is_split(model.manifest.name):
            name = model.manifest.name
            chosen = traffic_split.version_for(status.weights(name), routing.bucket(name))
            model = status.find_version(name, chosen) or model
        if routing is not None:
            routing.chosen = model
        return model

    def admitting_model(
        self,
        name: str | None,
        version: str | None,
        priority: Priority = "normal",
        deadline_s: float | None = None,
        routing: Routing | None = None,
    ) -> ModelInfo:
        """``serving_model``, checked before a request's body is read: also refused (429) when
        its engine would refuse any request at ``priority`` due at ``deadline_s`` (None: its
        body may set it) now, whatever its body (``EngineClient.refusal_before_body``): a storm
        of requests that would be refused costs no parse, and leaves the CPU to the forward
        (issue 23)."""
        model = self.serving_model(name, version, routing)
        manifest = model.manifest
        refused = self.engine.refusal_before_body(
            manifest.name, manifest.version, priority, deadline_s
        )
        if refused is not None:
            raise refused
        return model

    def answered_with(self, routing: Routing, status: int) -> None:
        """An inference request answered ``status``, counted under the version ``routing``
        chose (``batchserve_model_requests_total``; the engines count what the admin API's
        traffic window reports: ``engine/traffic_tally.py``)."""
        model = routing.chosen
        if model is None:
            return
        name, version = model.manifest.name, model.manifest.version
        self.request_tally.answered_by(name, version, str(status))

    def layout_for(self, model: ModelInfo) -> InputLayout:
        """How requests for ``model`` are parsed, validated and grouped (built once a version)."""
        key = model.manifest.version
        layout = self._layouts.get(key)
        if layout is None:
            layout = InputLayout(
                manifest=model.manifest,
                length_edges=model.length_edges,
                max_instances=self.settings.max_instances_per_request,
            )
            if len(self._layouts) >= _LAYOUT_CACHE_SIZE:
                del self._layouts[next(iter(self._layouts))]
            self._layouts[key] = layout
        return layout

    def handler_for(self, model: ModelInfo) -> Handler:
        """The version's handler (built once a version), or the tensors-in, tensors-out base
        ``Handler`` when it names none. Building verifies the hashes of the version's files
        other than the weights (the handler's code, its tokenizer) before importing any."""
        key = model.manifest.version
        handler = self._handlers.get(key)
        if handler is None:
            handler = self._build_handler(model)
            if len(self._handlers) >= _LAYOUT_CACHE_SIZE:
                del self._handlers[next(iter(self._handlers))]
            self._handlers[key] = handler
        return handler

    def loaded_text_model(self, model: ModelInfo) -> TextModel | None:
        """The version's ``text_model_for`` if it was read already (no files read: the
        event loop may ask)."""
        return self._text_models.get(model.manifest.version)

    def text_model_for(self, model: ModelInfo) -> TextModel:
        """A generative version's tokenizer, chat template and defaults (read once a version,
        from files checked against their hashes); 404 for a version that does not generate.
        Reads files: call it off the event loop."""
        key = model.manifest.version
        text_model = self._text_models.get(key)
        if text_model is None:
            manifest = model.manifest
            folder = self.repository.version_folder(manifest.name, manifest.version)
            try:
                self.repository.check_manifest(manifest)
                text_model = load_text_model(manifest, folder)
            except ModelNotFoundError:
                raise
            except Exception as error:  # unreadable or altered files: the version is unusable
                logger.error(
                    "tokenizer_unavailable", extra={"model": manifest.label, "error": str(error)}
                )
                raise HandlerError(
                    f"the tokenizer of {manifest.label} cannot be loaded: "
                    f"{str(error).replace(str(self.repository.root), '<repository>')}"
                ) from error
            if len(self._text_models) >= _LAYOUT_CACHE_SIZE:
                del self._text_models[next(iter(self._text_models))]
            self._text_models[key] = text_model
        return text_model

    def _build_handler(self, model: ModelInfo) -> Handler:
        manifest = model.manifest
        folder = self.repository.version_folder(manifest.name, manifest.version)
        context = HandlerContext(
            manifest=manifest,
            folder=folder,
            layout=self.layout_for(model),
            max_client_batch_size=self.settings.max_client_batch_size,
        )
        if manifest.handler is None:
            return Handler(context)
        try:  # the handler reads a private copy of the files whose hashes were checked
            with self.repository.verified_copy(manifest) as copy:
                handler = build_handler(replace(context, folder=copy.folder))
                copy.keep_while(handler)
        except Exception as error:  # operator code: whatever it raises, the version is unusable
            logger.error(
                "handler_unavailable", extra={"model": manifest.label, "error": str(error)}
            )
            raise HandlerError(
                f"the handler of {manifest.label} cannot be loaded: "
                f"{str(error).replace(str(self.repository.root), '<repository>')}"
            ) from error
        return handler

    def refresh_gauges(self) -> None:
        """Readiness, the engines reached, this process's memory and its requests tallied,
        into their metrics."""
        self.request_tally.flush()
        self.metrics.ready.set(1 if self.ready else 0)
        self.metrics.engines_ready.set(sum(engine.ready for engine in self.engine.engines()))
        self.process_metrics.refresh()
        for refresh in self.gauge_refreshers:
            refresh()
