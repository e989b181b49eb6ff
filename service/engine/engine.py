"""``Engine``: one device's models, their batchers and the device thread, as an
``EngineClient``.

Serving alone, the front end calls an ``Engine`` in its own process; behind the bridge, the
engine process's ``BridgeServer`` calls the same methods for every front end. Loading or
switching a version has two forms: ``switch`` (this engine alone) and ``prepare`` then
``commit`` or ``abort``, which a front end uses to switch several engines together, all or
none.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from service.bridge import published
from service.bridge.interface import (
    EngineStatus,
    GeneratedTokens,
    GenerateRequest,
    InferenceRequest,
    InferenceResult,
    ShadowReport,
    SwitchResult,
)
from service.bridge.streams import TokenQueue
from service.config import Settings
from service.engine import lifecycle
from service.engine.batcher import Sink, Submission, Ticket
from service.engine.compatibility import RequestContract, interchangeable, request_contract
from service.engine.generation_loop import GenerationLoop
from service.engine.model_store import ModelStore
from service.engine.shadow import Shadow, ShadowedGeneration
from service.engine.state import EngineState, ServedModel
from service.engine.switching import Switcher, load_shadow
from service.engine.traffic_tally import TalliedStreams, TrafficTally
from service.errors import (
    InvalidInputError,
    ModelNotFoundError,
    NotReadyError,
    ServiceError,
    VersionSwitchedError,
)
from service.manifest import Manifest
from service.metrics import EngineMetrics
from service.tensors import NamedArrays
from service.traffic_window import TrafficReport
from service.types import Priority

logger = logging.getLogger(__name__)

#: Versions whose contracts an engine remembers, to accept requests prepared for a version
#: it has just switched away from when the one served would prepare and answer them alike.
REMEMBERED_VERSIONS = 16


class FrameHeader(Protocol):
    """A request of a frame as its front end described it (``bridge.contract.Submit``)."""

    @property
    def model(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def priority(self) -> Priority: ...
    @property
    def deadline_s(self) -> float: ...
    @property
    def request_id(self) -> str: ...
    @property
    def trace(self) -> str | None: ...


#: A request of a frame: what its front end said of it, and its instances.
FrameRequest = tuple[FrameHeader, NamedArrays]
#: A queued request and the version that will compute it, or why it was refused.
Queued = tuple[Ticket[NamedArrays], str] | ServiceError


class Engine:
    """Loads and serves several models on one device, each a primary version and any
    versions loaded beside it (a traffic split)."""

    def __init__(
        self,
        settings: Settings,
        metrics: EngineMetrics,
        *,
        device: str | None = None,
        on_load_failure: Callable[[], None] | None = None,
        on_stall: Callable[[], None] | None = None,
    ) -> None:
        self.state = EngineState(
            settings=settings,
            metrics=metrics,
            store=ModelStore(settings.model_repository),
            device=device or settings.device,
            on_stall=on_stall,
        )
        self._on_load_failure = on_load_failure
        self._loading: asyncio.Task[None] | None = None
        self._switcher = Switcher(self.state)
        self._stopped: asyncio.Task[None] | None = None
        self._status: EngineStatus | None = None
        self._contracts: dict[str, RequestContract] = {}
        self._shadows: dict[str, Shadow] = {}
        self._tally = TrafficTally()
        self.state.listeners.append(self._forget_status)
        self.state.listeners.append(self._follow_shadow_copies)

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> asyncio.Task[None]:
        """Begin loading the configured (or recorded) models; call inside the event loop."""
        if self._loading is None:
            self.state.metrics.starts.labels(self.state.device).inc()
            self._loading = asyncio.get_running_loop().create_task(
                self._start_serving(), name="batchserve-engine-load"
            )
        return self._loading

    async def _start_serving(self) -> None:
        """The initial loads, then the shadows the published record keeps (an engine
        started after ``PUT .../shadow``, such as a replacement, resumes them). A shadow that
        cannot resume is logged and left off: what is served does not depend on it."""
        recorded = published.read_published()  # before the loads publish it anew
        await lifecycle.start_serving(self.state, self._on_load_failure)
        if not self.state.loaded:
            return
        for entry in recorded or ():
            if entry.shadow is None or entry.name not in self.state.models:
                continue
            version, percent = entry.shadow
            try:
                await self.start_shadow(entry.name, version, percent)
            except ServiceError as error:
                logger.error(
                    "shadow_not_resumed",
                    extra={"model": entry.name, "version": version, "error": str(error)},
                )

    @property
    def loading(self) -> asyncio.Task[None]:
        """The initial load; it records its failure in the status and never raises."""
        if self._loading is None:
            raise RuntimeError("Engine.start() has not been called")
        return self._loading

    async def shut_down(self) -> None:
        """Refuse new requests, answer every queued one, free the device (once)."""
        if self._stopped is None:
            self._stopped = asyncio.get_running_loop().create_task(self._shut_down())
        await asyncio.shield(self._stopped)

    async def _shut_down(self) -> None:
        await self.abort()
        for name in list(self._shadows):  # still recorded: an engine started next resumes it
            await self._unload_shadow(name)
        await lifecycle.shut_down(self.state, self.start())

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every change of ``status()``."""
        self.state.listeners.append(listener)

    @property
    def served(self) -> ServedModel | None:
        """The first model: the one ``/predict`` answers with."""
        return self.state.served

    # ----------------------------------------------------------------- EngineClient

    def status(self) -> EngineStatus:
        if self._status is None:
            self._status = EngineStatus(
                phase=self.state.phase,  # type: ignore[arg-type]
                models=tuple(
                    served.info(self.state.weight_of(name, served.manifest.version))
                    for name, served in self.state.models.items()
                ),
                beside=tuple(
                    served.info(self.state.weight_of(name, version))
                    for name, versions in self.state.beside.items()
                    for version, served in versions.items()
                ),
                previous=dict(self.state.previous_versions),
                detail=self.state.load_error,
                device=self.state.device,
                pid=os.getpid(),
            )
        return self._status

    def engines(self) -> list[EngineStatus]:
        return [self.status()]

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        ticket, version = self.enqueue(request)
        chunks = await ticket.wait()
        return InferenceResult(
            outputs=NamedArrays.concatenate(chunks, ticket.order),
            version=version,
            batches=ticket.traced_batches(),
        )

    def refusal_before_body(
        self, model: str, version: str, priority: Priority, deadline_s: float | None
    ) -> ServiceError | None:
        served = self.state.models.get(model)
        if served is not None and served.manifest.version != version:
            served = self.state.beside_copy(model, version) or served  # its own queue
        return None if served is None else served.batcher.refusal_of_any(priority, deadline_s)

    def enqueue(
        self, request: InferenceRequest, sink: Sink | None = None, tag: object = None
    ) -> tuple[Ticket[NamedArrays], str]:
        """Queue ``request`` now: its ticket, and the version that will compute it.

        ``sink`` is the front end it came from (None: this process, which waits on the
        ticket): the finished ticket goes to it with the others of its batch. ``tag``: the
        front end's name for the request.

        Raises ``NotReadyError`` when its model is not served (yet, or any more), and
        ``VersionSwitchedError`` when the request was prepared for a version no longer served
        that is not ``interchangeable`` with the one served now (its front end preprocessed
        it, and will postprocess the answer, for that version: see ``compatibility.py``).
        """
        served = self._serving(request.model, request.version)
        if isinstance(served, ServiceError):
            raise served
        manifest = served.manifest
        source = None if sink is None else id(sink)
        received_s = time.monotonic()
        self.state.frontend_loads[source] = (request.frontend_load, received_s)
        queued = served.queued(request.instances)
        ticket = served.batcher.enqueue(
            queued.payload,
            group=queued.group,
            cost_per_row=queued.cost_per_row,
            more=queued.more,
            order=queued.order,
            priority=request.priority,
            request_id=request.request_id,
            deadline_s=request.deadline_s,
            source=source,
            trace=request.traceparent,
            sink=self._tally.sink_for(sink) if self._counted(manifest.name) else sink,
            tag=tag,
        )
        if self._counted(manifest.name):
            self._tally.received(ticket, manifest.name, manifest.version, received_s)
        self._shadow_chosen(served, ticket, request.instances, request.request_id)
        return ticket, manifest.version

    def frontend_left(self, sink: Sink) -> None:
        """The front end ``sink`` closed its connection: the engine lets go of what it kept
        for it (its load, and the taps its answers pass through to the tally and the
        shadows), which would otherwise keep every front end that ever connected. Its
        requests still running keep their own taps."""
        self.state.frontend_loads.pop(id(sink), None)
        tap = self._tally.forget(sink)
        for shadow in self._shadows.values():  # its requests were queued with either
            shadow.forget(sink)
            if tap is not None:
                shadow.forget(tap)

    def enqueue_frame(
        self, requests: Sequence[FrameRequest], frontend_load: int, sink: Sink
    ) -> list[Queued]:
        """Queue the requests of one front end's frame at once: for each, in order, its ticket
        and version, or the error ``enqueue`` would have raised for it had they been queued
        one by one."""
        received_s = time.monotonic()
        self.state.frontend_loads[id(sink)] = (frontend_load, received_s)
        tap = self._tally.sink_for(sink)
        results: list[Queued | None] = [None] * len(requests)  # each set below
        serving: dict[tuple[str, str], ServedModel | ServiceError] = {}
        # By model served: its requests' indexes in the frame, and the requests.
        frames: dict[int, tuple[ServedModel, list[int], list[Submission]]] = {}
        for index, (request, instances) in enumerate(requests):
            key = (request.model, request.version)
            served = serving.get(key)
            if served is None:
                served = serving[key] = self._serving(*key)
            if isinstance(served, ServiceError):
                results[index] = served
                continue
            try:
                queued = served.queued(instances)
            except ServiceError as error:
                results[index] = error.with_traceback(None)  # no cycle through ``results``
                continue
            frame = frames.get(id(served))
            if frame is None:
                frame = frames[id(served)] = (served, [], [])
            frame[1].append(index)
            frame[2].append(
                Submission(
                    queued.payload,
                    queued.group,
                    queued.cost_per_row,
                    request.priority,
                    request.deadline_s,
                    request.request_id,
                    request.trace,
                    more=queued.more,
                    order=queued.order,
                )
            )
        for served, indexes, submissions in frames.values():
            name, version = served.manifest.name, served.manifest.version
            counted = self._counted(name)
            shadowed = name in self._shadows  # rare: no call per request without a shadow
            admitted = served.batcher.enqueue_frame(
                submissions, source=id(sink), sink=tap if counted else sink
            )
            for index, outcome in zip(indexes, admitted, strict=True):
                if isinstance(outcome, ServiceError):
                    results[index] = outcome
                    continue
                results[index] = (outcome, version)
                if counted:
                    self._tally.received(outcome, name, version, received_s)
                if shadowed:
                    request, instances = requests[index]
                    self._shadow_chosen(served, outcome, instances, request.request_id)
        return results  # type: ignore[return-value]  # every one set

    def _serving(self, model: str, version: str) -> ServedModel | ServiceError:
        """The model serving requests prepared for ``model@version``, or why none does: that
        very version when it is loaded (as the primary, or beside it)."""
        beside = self.state.beside.get(model)
        if beside is not None and version in beside:
            return beside[version]
        served = self.state.models.get(model)
        if served is None:
            return NotReadyError(
                f"{model} is not served by this engine now; retry when /readyz "
                "answers 200 and /models lists it"
            )
        manifest = served.manifest
        if version != manifest.version and not interchangeable(
            self._contracts.get(version), request_contract(manifest)
        ):
            return VersionSwitchedError(
                f"{model}@{version} is no longer served (now {manifest.label}), "
                "whose files (tokenizer, code), inputs, outputs or handler differ; retry"
            )
        return served

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GeneratedTokens]:
        generation = self.streams_of(request.model, request.version)
        stream = TokenQueue()
        key = generation.submit(request, stream)
        try:
            async for item in stream.until_finished():
                yield item
        finally:
            generation.cancel(key)  # nothing happens once it finished

    def generation_of(self, model: str, version: str) -> GenerationLoop | ShadowedGeneration:
        """The loop generating for requests prepared for ``model@version``: refused as
        ``enqueue`` refuses, and 422 for a model that does not generate; with a shadow of that
        version, the loop as the shadow watches it."""
        return self._generation(self._generating(model, version))

    def _generating(self, model: str, version: str) -> ServedModel:
        """The version generating for requests prepared for ``model@version``, or the
        refusal (``generation_of``)."""
        served = self._serving(model, version)
        if isinstance(served, ServiceError):
            raise served
        if served.generation is None:
            task = served.manifest.metadata.get("task", "a tensor model")
            raise InvalidInputError(
                f"{model} does not generate text ({task}); generation is served for "
                "text-generation versions (package a causal LM, a T5 or a BART with --hf)"
            )
        return served

    def streams_of(self, model: str, version: str) -> TalliedStreams:
        """``generation_of``, each stream counted in the traffic window when it ends: what
        a request's stream is submitted to."""
        served = self._generating(model, version)
        manifest = served.manifest
        return TalliedStreams(
            self._generation(served), self._tally, manifest.name, manifest.version
        )

    def _generation(self, served: ServedModel) -> GenerationLoop | ShadowedGeneration:
        shadow = self._shadows.get(served.manifest.name)
        assert served.generation is not None  # as _generating checked
        if shadow is not None and shadow.shadows(served):
            return ShadowedGeneration(served.generation, shadow)
        return served.generation

    async def switch(self, name: str, version: str) -> SwitchResult:
        try:
            return await self._switcher.switch(name, version)
        except BaseException:
            self._follow_shadow_copies()  # it may have unloaded a shadow's copy first
            raise

    async def rollback(self, name: str | None = None) -> SwitchResult:
        return await self.switch(*self.status().rollback_target(name))

    async def unload(self, name: str) -> str:
        if name in self._shadows and len(self.state.models) > 1:
            await self.stop_shadow(name)
        return await self._switcher.unload(name)

    async def split(self, name: str, weights: dict[str, int]) -> SwitchResult:
        await self.prepare_split(name, weights)
        return await self._switcher.commit()

    # ----------------------------------------------------------------- two-phase switch

    async def prepare(self, name: str, version: str) -> Manifest:
        """Load ``name`` at ``version`` beside the serving one and hold it until ``commit`` or
        ``abort``; meanwhile any other switch is refused (409)."""
        try:
            return await self._switcher.prepare(name, version)
        except BaseException:
            self._follow_shadow_copies()  # it may have unloaded a shadow's copy first
            raise

    async def prepare_split(self, name: str, weights: dict[str, int]) -> Manifest:
        """Load the versions of ``weights`` not loaded yet beside those of ``name`` and hold
        them until ``commit`` (which splits ``name``'s traffic by ``weights``) or ``abort``."""
        try:
            return await self._switcher.prepare_split(name, weights)
        except BaseException:
            self._follow_shadow_copies()  # it may have unloaded a shadow's copy first
            raise

    async def commit(self) -> SwitchResult:
        """Serve what ``prepare`` or ``prepare_split`` loaded (nothing changes if it was
        served already)."""
        return await self._switcher.commit()

    async def abort(self) -> None:
        """Discard what ``prepare`` loaded, if anything; the serving version stays."""
        await self._switcher.abort()
        self._follow_shadow_copies()

    async def traffic(self, name: str) -> TrafficReport:
        """What each version of ``name`` answered here within the window."""
        return self._tally.report(name)

    # ----------------------------------------------------------------- shadows

    async def start_shadow(self, name: str, version: str, percent: int) -> ShadowReport:
        """Copy ``percent`` of ``name``'s requests to ``version`` (loaded beside, in the
        background), answering each with the served version alone; a shadow of another
        version of ``name`` is replaced, one of the same version only changes its share."""
        served = self.state.models.get(name)
        if served is None:
            raise ModelNotFoundError(f"{name} is not served here; load it before shadowing it")
        current = self._shadows.get(name)
        target = self.state.store.resolve(name, version).version
        if current is not None and current.candidate_version == target:
            current.percent = percent
            self.state.shadow_percents[name] = percent
            lifecycle.publish(self.state)
            return current.report()
        candidate = await load_shadow(self.state, served, target)
        if current is not None:
            await self.stop_shadow(name)
        shadow = Shadow(
            served,
            candidate,
            percent,
            self.state.metrics,
            busy_requests=self.state.settings.max_batch_size,
        )
        self._shadows[name] = shadow
        self.state.shadow_candidates[name] = candidate
        self.state.shadow_percents[name] = percent
        lifecycle.publish(self.state)
        return shadow.report()

    async def shadow_report(self, name: str) -> ShadowReport:
        """What ``name``'s shadow found so far; 404 when it has none."""
        shadow = self._shadows.get(name)
        if shadow is None:
            raise ModelNotFoundError(f"{name} has no shadow; start one with PUT .../shadow")
        return shadow.report()

    async def stop_shadow(self, name: str) -> ShadowReport:
        """Stop copying ``name``'s requests and unload the candidate (its copies already
        queued run first); what the shadow found, last. 404 when it has none."""
        if name not in self._shadows:
            raise ModelNotFoundError(f"{name} has no shadow to stop")
        self.state.shadow_percents.pop(name, None)
        self.state.shadow_candidates.pop(name, None)
        lifecycle.publish(self.state)
        return await self._unload_shadow(name)

    async def _unload_shadow(self, name: str) -> ShadowReport:
        """Stop ``name``'s shadow here, unloading its candidate unless a split serves it."""
        shadow = self._shadows.pop(name)
        self.state.shadow_candidates.pop(name, None)
        await lifecycle.retire_unused(self.state, shadow.candidate)
        return shadow.report()

    def _follow_shadow_copies(self) -> None:
        """After a change: a shadow whose own copy made way for a served copy of its version
        (``lifecycle.release_shadow_copy``) runs on that copy; one left without a copy (its
        version is the primary now, or the load was aborted) stops."""
        followed = False
        for name, shadow in list(self._shadows.items()):
            if name in self.state.shadow_candidates:
                continue
            followed = True
            beside = self.state.beside_copy(name, shadow.candidate_version)
            if beside is None:
                del self._shadows[name]
                self.state.shadow_percents.pop(name, None)
                continue
            shadow.candidate = beside
            self.state.shadow_candidates[name] = beside
        if followed:
            lifecycle.publish(self.state)  # the change published before the shadow followed

    def _counted(self, name: str) -> bool:
        """Whether ``name``'s answers are counted by version (``GET .../traffic``): while it
        has a traffic split or a shadow, what a rollout judges; a model served by one version
        alone pays nothing for it."""
        return name in self.state.weights or name in self._shadows

    def _shadow_chosen(
        self,
        served: ServedModel,
        ticket: Ticket[NamedArrays],
        instances: NamedArrays,
        request_id: str,
    ) -> None:
        """Copy a queued request to its model's shadow when the shadow chooses it."""
        shadow = self._shadows.get(served.manifest.name)
        if shadow is not None and shadow.shadows(served) and shadow.chooses():
            shadow.watch(ticket, instances, request_id)

    # ----------------------------------------------------------------- internals

    def _forget_status(self) -> None:
        self._status = None
        versions = self._contracts
        for served in self.state.every_version():
            versions[served.manifest.version] = request_contract(served.manifest)
        while len(versions) > REMEMBERED_VERSIONS:
            del versions[next(iter(versions))]
