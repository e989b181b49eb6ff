"""What a front end asks of the engines, whether they run in its process or behind the bridge.

``EngineClient`` is the one interface the front end's routes use. ``engine.Engine`` implements
it in-process (one process, no hop); ``bridge.client.BridgeClient`` implements it over local
sockets to one engine process per device. A request and its answer cross the bridge in the
typed contract of ``contract.py``; the engine's status (``EngineStatus``, ``ModelInfo``)
crosses as JSON (``to_wire``/``from_wire``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from service.errors import ConflictError, EngineUnavailableError, NotReadyError, ServiceError
from service.manifest import Manifest
from service.tensors import NamedArrays
from service.traffic_window import TrafficReport
from service.types import Priority

Phase = Literal["connecting", "loading", "ready", "draining", "stalled", "failed", "down"]
"""``connecting``: a front end has not reached the engine yet; ``down``: it lost it."""
Role = Literal["active", "standby"]
"""``active``: the engine of its device that takes a front end's requests; ``standby``: one
that is ready to take over (``bridge/engines.py``)."""


@dataclass(frozen=True)
class ModelInfo:
    """The version an engine serves and how: what a front end validates requests against."""

    manifest: Manifest
    device: str
    precision: str
    compiled: bool
    length_edges: tuple[int, ...]
    """Length buckets of the inputs' shared variable axis (empty for fixed shapes)."""
    memory_bytes: int = 0
    """What loading and warming it up took on its device."""
    weight: int = 100
    """This version's share of its model's requests, percent (a traffic split); 0 for a
    version loaded beside that answers only requests naming it."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest.model_dump(mode="json"),
            "device": self.device,
            "precision": self.precision,
            "compiled": self.compiled,
            "length_edges": list(self.length_edges),
            "memory_bytes": self.memory_bytes,
            "weight": self.weight,
        }

    @classmethod
    def from_wire(cls, document: dict[str, Any]) -> ModelInfo:
        return cls(
            manifest=Manifest.model_validate(document["manifest"]),
            device=str(document["device"]),
            precision=str(document["precision"]),
            compiled=bool(document["compiled"]),
            length_edges=tuple(int(edge) for edge in document["length_edges"]),
            memory_bytes=int(document.get("memory_bytes", 0)),
            weight=int(document.get("weight", 100)),
        )


@dataclass(frozen=True)
class EngineStatus:
    """One engine's state as a front end last heard it."""

    phase: Phase
    models: tuple[ModelInfo, ...] = ()
    """Each model served, in the order loaded, as its primary version (the one with the most
    weight): the first answers ``/predict``."""
    beside: tuple[ModelInfo, ...] = ()
    """The versions loaded beside the primaries (a traffic split), each with its weight."""
    previous: dict[str, str] = field(default_factory=dict)
    """Each model's version served before its last switch: what a rollback goes back to."""
    detail: str | None = None
    """Why the engine failed or is down, for logs and ``/readyz``."""
    device: str = ""
    pid: int | None = None
    generation: int = 0
    """The order in which the supervisor started this engine process: of the ready engines of
    a device, the one started first is the active one."""
    role: Role | None = None
    """As one front end sees it (``bridge/engines.py``); not sent by the engine."""

    @property
    def model(self) -> ModelInfo | None:
        """The first model: the one ``/predict`` answers with."""
        return self.models[0] if self.models else None

    def find(self, name: str) -> ModelInfo | None:
        """The model served under ``name`` (its primary version), if any."""
        return next((model for model in self.models if model.manifest.name == name), None)

    def find_version(self, name: str, version: str) -> ModelInfo | None:
        """``name`` at ``version`` if it is loaded, as the primary or beside it."""
        for model in (*self.models, *self.beside):
            if model.manifest.name == name and model.manifest.version == version:
                return model
        return None

    def weights(self, name: str) -> dict[str, int]:
        """The traffic split of ``name`` over its loaded versions, the primary first (empty
        when ``name`` is not served)."""
        return {
            model.manifest.version: model.weight
            for model in (*self.models, *self.beside)
            if model.manifest.name == name
        }

    def is_split(self, name: str) -> bool:
        """Whether ``name`` has versions loaded beside its primary."""
        return any(model.manifest.name == name for model in self.beside)

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and bool(self.models)

    def rollback_target(self, name: str | None) -> tuple[str, str]:
        """(name, version) a rollback of ``name`` (the first model when None) switches to:
        the version it served before its last switch; 409 when there is none. Not ready (an
        engine restarting, which learns what came before from the published record), it
        cannot tell: 503 with ``Retry-After``."""
        if not self.ready:
            raise self.refusal()
        if name is None:
            name = self.model.manifest.name if self.model else ""
        previous = self.previous.get(name)
        if previous is None:
            raise ConflictError(
                f"no earlier version of {name or 'the model'} was served; nothing to roll back"
            )
        return name, previous

    def refusal(self) -> ServiceError:
        """What a request is answered while no engine is ready: 503 with ``Retry-After``,
        ``engine_unavailable`` when the engine is gone or hung, ``not_ready`` otherwise."""
        if self.phase in ("down", "connecting", "stalled"):
            return EngineUnavailableError(
                f"no inference engine is available ({self.phase}); retry shortly"
            )
        return NotReadyError(
            f"the model is not ready ({self.phase}); retry when /readyz answers 200"
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "models": [model.to_wire() for model in self.models],
            "beside": [model.to_wire() for model in self.beside],
            "previous": self.previous,
            "detail": self.detail,
            "device": self.device,
            "pid": self.pid,
            "generation": self.generation,
        }

    @classmethod
    def from_wire(cls, document: dict[str, Any]) -> EngineStatus:
        return cls(
            phase=document["phase"],
            models=tuple(ModelInfo.from_wire(model) for model in document.get("models", ())),
            beside=tuple(ModelInfo.from_wire(model) for model in document.get("beside", ())),
            previous={str(name): str(version) for name, version in document["previous"].items()},
            detail=document.get("detail"),
            device=str(document.get("device", "")),
            pid=document.get("pid"),
            generation=int(document.get("generation", 0)),
        )


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One validated request, ready to be queued for a batch."""

    model: str
    version: str
    """The version whose input spec validated ``instances``."""
    instances: NamedArrays
    """One array per input name, one row per instance."""
    priority: Priority
    deadline_s: float
    """``time.monotonic()`` at which the request is answered 504 (the clock is system-wide)."""
    request_id: str
    frontend_load: int = 1
    """Requests the front end holds now, their bodies read and not yet answered, this one
    included: how many batch-mates the adaptive policy may wait for (uploads still arriving
    do not count)."""
    traceparent: str | None = None
    """The W3C trace context of the front end's span waiting for this request, when traced."""


@dataclass(frozen=True, slots=True)
class InferenceResult:
    outputs: NamedArrays
    """One array per output name, one row per instance."""
    version: str
    """The version that computed ``outputs``."""
    batches: tuple[tuple[str, int], ...] = ()
    """For a traced request: each batch that computed part of it, as the batch span's
    ``traceparent`` and the rows of this request it held."""


ENCODER_DECODER_TASK = "text2text-generation"
"""``manifest.metadata["task"]`` of an encoder-decoder (T5, BART), generated in cohorts."""
GENERATIVE_TASKS = frozenset({"text-generation", ENCODER_DECODER_TASK})
"""``manifest.metadata["task"]`` of a version served by ``EngineClient.generate``."""

FinishReason = Literal["stop", "length", "error"]
"""``stop``: an end-of-sequence or stop token; ``length``: ``max_tokens`` or the room the
context leaves; ``error``: the sequence failed (non-finite logits, or its version had to go)."""


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One validated generation request: token ids in, token ids out (the front end
    tokenizes and detokenizes)."""

    model: str
    version: str
    """The version the front end tokenized for; 409/503 when it is no longer served, as for
    ``infer``."""
    prompt_ids: tuple[int, ...]
    max_tokens: int | None = None
    """New tokens at most; ``None``: as many as the context leaves."""
    temperature: float = 1.0
    """0: greedy."""
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    """Sampling with a seed gives the same tokens whatever the batch-mates."""
    logprobs: int | None = None
    """None: no log-probabilities; ``k >= 0``: the chosen token's, and the top ``k``."""
    frequency_penalty: float = 0.0
    """OpenAI's: a token's logit less this for each time the sequence generated it."""
    presence_penalty: float = 0.0
    """OpenAI's: a token's logit less this once the sequence generated it."""
    repetition_penalty: float = 1.0
    """``transformers``': a seen token's positive logit divided by it, a negative one
    multiplied."""
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end the sequence beside the model's end-of-sequence ids (included in the
    output, as the end-of-sequence id is)."""
    ignore_eos: bool = False
    """Generate past the model's end-of-sequence ids (benchmarks)."""
    priority: Priority = "normal"
    """Waiting requests join the running batch high before normal."""
    deadline_s: float = float("inf")
    """``time.monotonic()`` by which the first token must have come (``request_timeout_ms``,
    or the client's sooner limit): a request still queued then ends with 504."""
    stream_deadline_s: float = float("inf")
    """``time.monotonic()`` by which the stream must have ended (``generation_timeout_s``):
    when it passes, the stream ends with 504 after the tokens it had."""
    request_id: str = ""
    traceparent: str | None = None
    """The W3C trace context of the front end's span waiting for this request, when traced."""


@dataclass(frozen=True, slots=True)
class GeneratedTokens:
    """One or more new tokens of one stream, in order (coalesced when several came between
    two sends)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    """The log-probability of each token of ``token_ids`` (when the request asked)."""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    """For each token of ``token_ids``, the top ``logprobs`` (id, log-probability) pairs."""
    finish_reason: FinishReason | None = None
    """Set on the stream's last item."""
    version: str = ""
    """The version that generated the stream (one version from its first token to its
    last)."""

    @classmethod
    def joined(cls, items: Sequence[GeneratedTokens]) -> GeneratedTokens:
        """Consecutive items of one stream as one (their tokens in order, the last one's
        ``finish_reason``)."""
        if len(items) == 1:
            return items[0]
        logprobs = [item.logprobs for item in items]
        top = [item.top_logprobs for item in items]
        return cls(
            token_ids=tuple(token for item in items for token in item.token_ids),
            logprobs=None
            if any(each is None for each in logprobs)
            else tuple(value for each in logprobs for value in each or ()),
            top_logprobs=None
            if any(each is None for each in top)
            else tuple(pairs for each in top for pairs in each or ()),
            finish_reason=items[-1].finish_reason,
            version=items[0].version,
        )


@dataclass(frozen=True)
class SwitchResult:
    serving: Manifest
    replaced: str | None
    """``name@version`` switched away from, or None when ``serving`` was served already."""


class EngineClient(Protocol):
    """The engines as one front end sees them."""

    def status(self) -> EngineStatus:
        """Ready when some engine can take requests; otherwise the most telling state."""
        ...

    def engines(self) -> list[EngineStatus]:
        """Each engine's state, in device order."""
        ...

    def refusal_before_body(
        self, model: str, version: str, priority: Priority, deadline_s: float | None
    ) -> ServiceError | None:
        """The refusal any request to ``model@version`` (its primary, or a version loaded
        beside it: each has its own queue) at ``priority`` due at ``deadline_s`` (None:
        its body may set it) would get now whatever its body (a full queue, or more work ahead
        than time left), or None: a front end asks before parsing a body, so a storm of
        requests that would be refused costs no parse. Only an engine in this process can
        tell; over the bridge it is None and the engine refuses after the parse."""
        ...

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        """Queue ``request`` on an engine and wait for its rows; raises ``ServiceError``s."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GeneratedTokens]:
        """The new tokens of ``request`` as they come. Refusals raise ``ServiceError`` before
        the first item (404 unknown model, 409 version no longer served, 422 prompt +
        max_tokens never fit the context, 429 with Retry-After when the KV cache and the
        waiting room are full, 503 not ready). Closing the iterator early (``aclose()``, or
        the task awaiting it cancelled) cancels the sequence: its slot is free within one
        step."""
        ...

    async def switch(self, name: str, version: str) -> SwitchResult:
        """Load, verify and warm up ``name`` at ``version`` on every engine, then serve it on
        all of them, or on none if any refuses: beside the models served, or in place of the
        version of ``name`` served now."""
        ...

    async def rollback(self, name: str | None = None) -> SwitchResult:
        """Switch ``name`` (the first model when None) back to the version it served before
        its last switch."""
        ...

    async def unload(self, name: str) -> str:
        """Stop serving ``name`` on every engine (its queued requests finish first) and free
        its memory; returns the ``name@version`` unloaded."""
        ...

    async def split(self, name: str, weights: dict[str, int]) -> SwitchResult:
        """Serve the versions of ``name`` that ``weights`` names (``traffic_split.py``), on
        every engine or none: each version not loaded yet is loaded, verified and warmed up
        beside the others first; then the one with the most weight is the primary, versions
        left out are unloaded (their queued requests finish first). ``{v: 100}`` serves ``v``
        alone."""
        ...

    async def traffic(self, name: str) -> TrafficReport:
        """What each version of ``name`` answered within the recent window, on every engine
        together (``traffic_window.py``): each engine sees every front end's requests."""
        ...

    async def start_shadow(self, name: str, version: str, percent: int) -> ShadowReport:
        """Load ``version`` of ``name`` beside it on every engine (or on none, if any
        refuses) and copy ``percent`` of ``name``'s requests to it (``engine/shadow.py``)."""
        ...

    async def shadow_report(self, name: str) -> ShadowReport:
        """What ``name``'s shadow found, summed over the engines; 404 when it has none."""
        ...

    async def stop_shadow(self, name: str) -> ShadowReport:
        """Stop ``name``'s shadow on every engine and unload its candidate; what it found."""
        ...


@dataclass(frozen=True)
class ShadowReport:
    """What one model's shadow found (``engine/shadow.py``): on one engine, or summed over
    every engine (``summed``)."""

    model: str
    version: str
    """The candidate version."""
    served_version: str
    percent: int
    chosen: int = 0
    """Requests chosen to be copied to the candidate."""
    compared: int = 0
    disagreed: int = 0
    failed: int = 0
    """Copies the candidate failed (it raised)."""
    dropped: int = 0
    """Copies shed before they ran: the shadow's queue was full, the served queue long, the
    candidate refused them, or their deadline passed before the device was idle for them."""
    candidate_p50_s: float | None = None
    candidate_p99_s: float | None = None
    """From queueing a copy on the candidate to its answer (it waits for an idle device)."""
    served_p99_s: float | None = None
    """From queueing a chosen request to its answer, on the served version."""
    disagreements: tuple[dict[str, str], ...] = ()
    """The most recent disagreements, oldest first (``comparison.Disagreement``)."""

    @property
    def disagreement(self) -> float:
        """The share of compared requests that disagreed (0 when none was compared)."""
        return self.disagreed / self.compared if self.compared else 0.0

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "served_version": self.served_version,
            "percent": self.percent,
            "chosen": self.chosen,
            "compared": self.compared,
            "disagreed": self.disagreed,
            "disagreement": self.disagreement,
            "failed": self.failed,
            "dropped": self.dropped,
            "candidate_p50_s": self.candidate_p50_s,
            "candidate_p99_s": self.candidate_p99_s,
            "served_p99_s": self.served_p99_s,
            "disagreements": list(self.disagreements),
        }

    @classmethod
    def from_wire(cls, document: dict[str, Any]) -> ShadowReport:
        return cls(
            model=str(document["model"]),
            version=str(document["version"]),
            served_version=str(document["served_version"]),
            percent=int(document["percent"]),
            chosen=int(document["chosen"]),
            compared=int(document["compared"]),
            disagreed=int(document["disagreed"]),
            failed=int(document["failed"]),
            dropped=int(document["dropped"]),
            candidate_p50_s=document.get("candidate_p50_s"),
            candidate_p99_s=document.get("candidate_p99_s"),
            served_p99_s=document.get("served_p99_s"),
            disagreements=tuple(document.get("disagreements", ())),
        )

    @classmethod
    def summed(cls, reports: Sequence[ShadowReport]) -> ShadowReport:
        """Several engines' reports of one shadow as one: counts added, each percentile the
        largest of the engines' (an upper bound), disagreements joined."""
        first = reports[0]

        def largest(values: Sequence[float | None]) -> float | None:
            known = [value for value in values if value is not None]
            return max(known) if known else None

        return cls(
            model=first.model,
            version=first.version,
            served_version=first.served_version,
            percent=first.percent,
            chosen=sum(report.chosen for report in reports),
            compared=sum(report.compared for report in reports),
            disagreed=sum(report.disagreed for report in reports),
            failed=sum(report.failed for report in reports),
            dropped=sum(report.dropped for report in reports),
            candidate_p50_s=largest([report.candidate_p50_s for report in reports]),
            candidate_p99_s=largest([report.candidate_p99_s for report in reports]),
            served_p99_s=largest([report.served_p99_s for report in reports]),
            disagreements=tuple(entry for report in reports for entry in report.disagreements),
        )
