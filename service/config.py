"""Typed settings, read once from ``BATCHSERVE_*`` environment variables.

Every field states its unit in its name and its accepted range in its constraints, so a bad
value fails at start-up with a message naming the variable, the value and the range.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Literal

import orjson
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ENV_PREFIX = "BATCHSERVE_"
#: Seconds added to the request timeout when waiting for requests to finish at shutdown.
SHUTDOWN_MARGIN_S = 5

#: The repository of the source checkout, holding the embedded demo models.
BUNDLED_MODEL_REPOSITORY = Path(__file__).resolve().parent.parent / "models"

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
_LISTED_DEVICE_PATTERN = re.compile(r"^(cpu|cuda:\d+)$")

Precision = Literal["fp32", "fp16", "bf16"]
BatchPolicy = Literal["adaptive", "fixed"]
CompileMode = Literal[
    "off", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
]
LogLevel = Literal["debug", "info", "warning", "error"]
EngineMode = Literal["auto", "in_process", "process"]


class Settings(BaseSettings):
    """All configuration of one batchserve process."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        protected_namespaces=(),
        use_attribute_docstrings=True,
    )

    host: str = "127.0.0.1"
    """Address the HTTP server binds to; use 0.0.0.0 in a container."""

    port: int = Field(default=8000, ge=1, le=65535)
    """TCP port of the HTTP server."""

    grpc_port: int = Field(default=0, ge=0, le=65535)
    """TCP port of the Open Inference Protocol's gRPC service (``GRPCInferenceService``) on
    ``host``; 0 leaves gRPC off. Every front end listens on it, like on ``port``."""

    workers: int = Field(default=1, ge=1, le=64)
    """HTTP front-end processes (gunicorn with uvicorn workers). They parse, validate and
    answer; the model runs in one engine process per device, shared by all of them."""

    engine_mode: EngineMode = "auto"
    """``in_process``: one process serves alone, front end and engine in one event loop (one
    worker, one device); ``process``: a supervisor runs the front ends and one engine process
    per device; ``auto``: ``in_process`` for one worker on one device without
    ``standby_engines``, else ``process``."""

    standby_engines: int = Field(default=0, ge=0, le=4)
    """Warm standby engine processes per device, besides the active one (engine processes
    only). A standby has imported torch, loaded and warmed up every served model and
    connected to every front end, but takes no batches; when the active engine dies or is
    declared hung, the front ends switch to it at once (its requests in flight are answered
    503) and the supervisor starts a new standby. Each standby holds a full copy of every
    model: 0 by default, as a CPU engine restarts in about its ``import torch`` time and
    memory is often the limit there; 1 is recommended on GPU hosts, where a new engine must
    also start CUDA, load the weights and compile before it serves."""

    spare_engine: bool = True
    """Keep one spare engine interpreter per host (engine processes only): a process that has
    imported torch and the engine, waiting to become whichever engine must start next (a
    restart after a crash or a hang, a new standby), which then only loads its models: an
    engine's restart on a CPU host takes its load time instead of seconds of imports. It
    costs an idle interpreter's memory (measured: 236 MiB resident, 165-190 MiB proportional, as
    torch's libraries are shared with the engines) and no CPU while it waits; on by default,
    as a crash is an outage for every front end without a standby. On a GPU the CUDA context
    and the weights are still paid when it becomes an engine: ``standby_engines`` is the GPU
    answer. A spare that does not answer within ``engine_heartbeat_timeout_s`` when it is
    taken (stopped, wedged) is killed and the engine started fresh."""

    engine_heartbeat_timeout_s: float = Field(default=1.5, ge=0.5, le=600.0)
    """An engine process that sends nothing for this long once it has loaded its models
    (``engine_start_heartbeat_timeout_s`` before) is treated as hung: the supervisor
    kills and restarts it, so a hung engine is replaced within about 2 s, and the front ends
    answer its requests 503 as its socket closes (on their own they give up on an engine
    quiet for twice this long). The heartbeats come from the engine's event loop, never the device
    thread, so a long forward does not delay them; the loop's longest pause (a full garbage
    collection at a version switch) is about 0.1 s on a quiet host. Raise it on a host so
    overloaded that the loop can pause this long. (A model that hangs inside a batch is
    caught by ``stall_timeout_s``.)"""

    engine_heartbeat_interval_s: float = Field(default=0.25, gt=0.0, le=60.0)
    """How often an engine tells the supervisor (its heartbeat file) and every front end (a
    status frame) that it is alive; at most a quarter of ``engine_heartbeat_timeout_s``, so
    that one late heartbeat never looks like a hung engine."""

    engine_start_heartbeat_timeout_s: float = Field(default=30.0, ge=0.5, le=3600.0)
    """How long an engine that is still starting (importing torch and the engine, loading and
    warming up its models) may leave its heartbeat file untouched before the supervisor kills
    it and starts another; at least ``engine_heartbeat_timeout_s``. A starting engine beats
    from a thread from its first instant, so a slow import or a long load is not mistaken for
    a hang, and one that is stopped or wedged is replaced within this time (plus its
    replacement's start). Longer than the heartbeat timeout because a full garbage collection
    while loading pauses every thread of the process: seconds on a busy host."""

    model_repository: Path = BUNDLED_MODEL_REPOSITORY
    """Folder holding ``<name>/<version>/manifest.json``; defaults to the embedded demo models."""

    model_name: str = Field(default="digits", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
    """Name of the model to serve (a plain identifier)."""

    model_version: str = Field(default="latest", pattern=r"^(latest|[0-9a-f]{12})$")
    """``latest`` (the newest packaged version by creation time; an export is served only
    by its id) or a 12-hex-character version id."""

    models: Annotated[tuple[str, ...], NoDecode] = ()
    """Several models served by every engine, each ``name`` or ``name@version``
    (``digits,textenc@ba5b32c1c5e8``); the first answers ``/predict``. Empty serves
    ``model_name`` at ``model_version`` alone."""

    device_memory_budget_mb: int = Field(default=0, ge=0, le=16_777_216)
    """Most memory the models of one engine may take on its device, in MiB, each measured
    after its warm-up (CUDA: ``torch.cuda.memory_allocated``; CPU: growth of the engine's
    resident memory); a load that would exceed it is refused with 409. 0: no budget."""

    device: str = "auto"
    """``auto`` (every GPU when there are any, else the CPU), ``cpu``, ``cuda`` (every GPU),
    ``cuda:N``, or a list of devices (``cuda:0,cuda:2``); one engine serves each device."""

    precision: Precision = "fp32"
    """``fp32``, or autocast to ``bf16`` (CPU and CUDA) or ``fp16`` (CUDA only); a causal
    language model generates with its weights cast to that dtype once, at load."""

    compile_mode: CompileMode = "off"
    """``off``, or a ``torch.compile`` mode; compiling happens at load, before readiness."""

    torch_threads: int = Field(default=0, ge=0, le=1024)
    """Threads torch uses inside one operator; 0 means one per CPU core minus one (at least
    one), leaving a core to the event loop that parses requests."""

    device_instances: int = Field(default=1, ge=1, le=64)
    """Model instances per device (Triton's instance groups): device threads fed by the one
    batcher, each running a batch at a time on ``torch_threads`` divided between them; the
    adaptive policy splits the requests the front ends hold into a batch an instance, so that
    all run at once. 1 for a GPU; on a CPU host, 2 or more let one engine use every core (see
    Benchmarks)."""

    max_batch_size: int = Field(default=64, ge=1, le=4096)
    """Most rows (instances) run in one forward pass."""

    max_wait_ms: float = Field(default=5.0, ge=0.0, le=1000.0)
    """Longest a queued request waits for batch-mates, counted from the oldest queued request."""

    batch_policy: BatchPolicy = "adaptive"
    """``adaptive``: once the device is free, dispatch at once unless requests are still being
    received (then wait for them, at most ``max_wait_ms``) or the clients the last batch
    answered are still coming back (then wait as long as they lately took, at most 4 x
    ``max_wait_ms``); ``fixed``: always wait up to ``max_wait_ms`` for a full batch."""

    length_buckets: Annotated[tuple[int, ...], NoDecode] = ()
    """Bucket edges for variable-length inputs (``8,32,128,512``); requests share a batch only
    within a bucket. Empty means powers of two from 8 up to the model's maximum length."""

    max_batch_tokens: int = Field(default=16_384, ge=1, le=10_000_000)
    """Most padded positions (rows x bucket length) in one batch of a variable-length model
    (TEI's setting of the same name). Batches are formed across requests under it: a request
    of many texts to a model answering one row each (an embedding model, a reranker) is
    sorted by length into a part per length bucket, each trimmed to its longest text, so its
    short texts share batches with other short texts rather than pad to its longest; each
    caller gets its rows back in its own order."""

    max_batch_ms: float = Field(default=100.0, ge=0.0, le=600_000.0)
    """The time quantum: a batch is cut (and a request of many rows split) so its forward,
    as fast as it was ever measured, stays under this many milliseconds; between two batches
    of a length bucket that keeps the device busy, requests of the other buckets get their
    turn, so a short request waits about one quantum (or one row of the longest bucket, if
    longer) rather than a whole long batch. A batch may always hold one longest row's worth of
    padded positions (e.g. four 128-token rows beside 512-token ones), whatever the quantum.
    100 (the default): on a CPU serving ``textenc`` (a 512-token row takes 60 ms) short
    requests beside a full 512-token bucket stayed within 4-7x of their latency alone, at no
    measured cost to the long ones (see Benchmarks); a GPU's batches rarely reach it. 0: no
    quantum, batches bounded by ``max_batch_size`` and ``max_batch_tokens`` only."""

    max_run_ms: float = Field(default=20.0, ge=0.0, le=10_000.0)
    """While every group queued holds a full batch (an overload, or a file given to
    ``batchserve predict``), the device is handed several of those batches at once, to run
    back to back for up to this many milliseconds by their measured times: between them it
    waits for no turn of the event loop, and the event loop does not share the interpreter
    with the forward. A request that arrives meanwhile waits for the rest of the run. A group
    still filling ends the run. With one device instance only. 0: one batch at a time."""

    max_queue_size: int = Field(default=2048, ge=1, le=1_000_000)
    """Most requests waiting in the queue; one more is answered 429 at once."""

    kv_cache_mb: int = Field(default=512, ge=1, le=16_777_216)
    """Device memory for the KV cache of each generative model, in MiB, allocated when it
    loads (and within what ``device_memory_budget_mb`` leaves, when set): it holds as many
    sequences of the model's whole context as fit, at most ``max_running_sequences``."""

    max_running_sequences: int = Field(default=32, ge=1, le=4096)
    """Most sequences a generative model generates at once: each generation step runs one
    forward over all of them."""

    max_waiting_sequences: int = Field(default=64, ge=0, le=1_000_000)
    """Most generation requests waiting for a KV-cache slot of their model when every slot is
    taken; one more is answered 429 at once."""

    prefill_chunk_tokens: int = Field(default=512, ge=1, le=1_000_000)
    """Most prompt tokens a generation step prefills, over all the sequences joining: a long
    prompt is cut over several steps, so the running streams keep their pace."""

    refusal_hold_ms: float = Field(default=2000.0, ge=0.0, le=60_000.0)
    """Longest a refusal for load (429) is held on a connection that sent its request before
    the ``Retry-After`` of its last 429 had passed: such a client is made to wait it out, so
    clients that resend at once cost one refusal per ``Retry-After`` each, not a storm that
    takes the model's CPU. A connection's first 429 is answered at once. The same holds over
    gRPC (``RESOURCE_EXHAUSTED``, by the connection's peer), answered before the call's own
    deadline. 0: never held."""

    request_timeout_ms: float = Field(default=10_000.0, ge=1.0, le=600_000.0)
    """Deadline of a request from its arrival; past it the request is answered 504. For a
    generation stream, the deadline of its first token (``generation_timeout_s`` bounds the
    rest)."""

    generation_timeout_s: float = Field(default=600.0, ge=1.0, le=86_400.0)
    """Longest a generation stream may run from its arrival: past it the stream ends with
    504 (an error event when it has started), and its sequence leaves the batch at the next
    step. Its first token must come within ``request_timeout_ms`` (or the client's sooner
    limit)."""

    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    """Largest accepted request body; a larger one is answered 413 before it is read whole."""

    max_header_bytes: int = Field(default=32 * 1024, ge=1024, le=1024 * 1024)
    """Largest request line and headers together, in bytes; a larger head is answered 431
    and its connection closed as soon as that many bytes have come without it ending."""

    header_timeout_s: float = Field(default=5.0, gt=0.0, le=300.0)
    """Time for a request's line and headers to arrive whole, counted from the connection
    opening (or a kept-alive connection's next byte); past it the connection is closed (408
    if part of a request came). Stops clients that trickle a request from holding connections."""

    keep_alive_timeout_s: int = Field(default=5, ge=1, le=3600)
    """How long an idle kept-alive connection stays open after its last answer. Keep it
    below a load balancer's idle timeout in front of batchserve."""

    max_requests_per_frontend: int = Field(default=1024, ge=1, le=1_000_000)
    """Most prediction requests one front end holds at once, uploads still arriving included
    (each at most ``request_timeout_ms``); the next is answered 503 with ``Retry-After`` at
    once. Bounds what slow clients can pin."""

    max_instances_per_request: int = Field(default=1024, ge=1, le=1_000_000)
    """Most instances in one request; requests above ``max_batch_size`` are split and rejoined."""

    max_client_batch_size: int = Field(default=512, ge=1, le=1_000_000)
    """Most texts in one request to an embedding model or a reranker (TEI's setting of the
    same name); one more is answered 413 before any is tokenized, saying to split the texts
    over several requests. ``max_instances_per_request`` holds too (422 above it)."""

    response_cache_mb: int = Field(default=0, ge=0, le=1_048_576)
    """Memory each front end may keep engine answers in, in MiB, so a repeated input of a
    model named in ``response_cache_models`` is answered without a forward; 0 leaves the
    cache off. Each front end (``workers``) keeps its own cache of this size."""

    response_cache_models: Annotated[tuple[str, ...], NoDecode] = ()
    """The models whose answers the response cache keeps (``digits,textenc``), or ``*`` for
    every model: name only models whose answer depends on their input alone (no sampling,
    no randomness in the forward)."""

    handler_threads: int = Field(default=0, ge=0, le=64)
    """Threads per front end that run a version's handler preprocessing (tokenizing,
    decoding images) and parse tensor bodies over 256 KiB, off the event loop, so one costly
    request never delays another or ``/healthz``; 0 means one per CPU core, from 2 to 4.
    Pillow releases the GIL while decoding, so threads also use more cores for images."""

    drain_delay_s: float = Field(default=0.0, ge=0.0, le=300.0)
    """After SIGTERM, how long ``/readyz`` answers 503 while still serving, before the listening
    socket closes (lets a load balancer stop sending first). Queued requests finish either way."""

    stall_timeout_s: float = Field(default=120.0, ge=0.0, le=3600.0)
    """A batch (or a generation step) running longer than this marks the model hung:
    ``/healthz`` and ``/readyz`` answer 503 so the process is replaced (0 turns the watchdog
    off)."""

    admin_token: SecretStr | None = Field(default=None, min_length=16)
    """Bearer token for the ``/admin`` routes (load and roll back versions), at least 16
    characters (a shorter one stops the start); unset disables them. Never logged or echoed."""

    warmup_batch_sizes: Annotated[tuple[int, ...], NoDecode] = ()
    """Batch sizes run once at load; empty means powers of two up to ``max_batch_size``."""

    log_level: LogLevel = "info"
    """Level of the JSON log lines written to stdout by the service, uvicorn and gunicorn."""

    library_log_level: LogLevel = "warning"
    """Level of every other library's log lines (Pillow, python-multipart, asyncio, grpc,
    ...): ``debug`` at ``log_level`` ``debug`` would flood the log with, say, Pillow's PNG
    chunks."""

    access_log: bool = False
    """One JSON line per HTTP request and gRPC ``ModelInfer`` call, on the ``batchserve.access``
    logger, whatever ``log_level`` says. Off by default: a line per request costs CPU on every
    request (see Monitoring) and a server behind a proxy or mesh usually has its access log
    there already."""

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        devices = [part.strip() for part in value.split(",")]
        if len(devices) == 1 and _DEVICE_PATTERN.match(devices[0]):
            return devices[0]
        if len(devices) > 1 and all(_LISTED_DEVICE_PATTERN.match(part) for part in devices):
            return ",".join(devices)
        raise ValueError(
            f"must be auto, cpu, cuda, cuda:N or a list of cpu and cuda:N, got {value!r}"
        )

    @field_validator("warmup_batch_sizes", "length_buckets", mode="before")
    @classmethod
    def _split_comma_separated(cls, value: object) -> object:
        """``8,64,512`` or ``[8, 64, 512]`` (environment variables and flags are strings)."""
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            try:
                return orjson.loads(value)
            except orjson.JSONDecodeError:
                raise ValueError(f"not a JSON list of integers: {value!r}") from None
        return tuple(part for part in value.split(",") if part.strip())

    @field_validator("models", mode="before")
    @classmethod
    def _split_model_list(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("response_cache_models", mode="before")
    @classmethod
    def _split_cached_model_list(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("response_cache_models")
    @classmethod
    def _check_cached_model_list(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [name for name in value if name != "*" and not _MODEL_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"model names are plain identifiers or *, got {bad!r}")
        return value

    @field_validator("models")
    @classmethod
    def _check_model_list(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        names = [_model_and_version(entry)[0] for entry in value]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"each model may be listed once, got {repeated} twice in {value!r}")
        return value

    def served_models(self) -> list[tuple[str, str]]:
        """(name, version) of each model to serve, in order: ``models``, or else
        ``model_name`` at ``model_version``."""
        if not self.models:
            return [(self.model_name, self.model_version)]
        return [_model_and_version(entry) for entry in self.models]

    @field_validator("warmup_batch_sizes", "length_buckets")
    @classmethod
    def _check_positive_sizes(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(size < 1 for size in value):
            raise ValueError(f"every size must be at least 1, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_cross_fields(self) -> Settings:
        if self.engine_mode == "in_process" and (self.workers > 1 or "," in self.device):
            raise ValueError(
                "engine_mode in_process serves with one worker on one device; "
                f"got workers={self.workers}, device={self.device!r}: use engine_mode=process"
            )
        if self.engine_mode == "in_process" and self.standby_engines > 0:
            raise ValueError(
                f"standby_engines {self.standby_engines} needs engine processes: use "
                "engine_mode=process (or auto with workers > 1), or standby_engines=0"
            )
        chunks = math.ceil(self.max_instances_per_request / self.max_batch_size)
        if chunks > self.max_queue_size:
            raise ValueError(
                f"max_queue_size {self.max_queue_size} cannot hold a request of "
                f"max_instances_per_request {self.max_instances_per_request} instances, which "
                f"is queued as {chunks} chunks of max_batch_size {self.max_batch_size}: such a "
                "request would be refused 429 forever; raise max_queue_size or lower "
                "max_instances_per_request"
            )
        if self.engine_heartbeat_interval_s * 4 > self.engine_heartbeat_timeout_s:
            raise ValueError(
                f"engine_heartbeat_interval_s {self.engine_heartbeat_interval_s} must be at most "
                f"a quarter of engine_heartbeat_timeout_s {self.engine_heartbeat_timeout_s}: "
                "lower the interval or raise the timeout"
            )
        if self.engine_start_heartbeat_timeout_s < self.engine_heartbeat_timeout_s:
            raise ValueError(
                "engine_start_heartbeat_timeout_s "
                f"{self.engine_start_heartbeat_timeout_s} must be at least "
                f"engine_heartbeat_timeout_s {self.engine_heartbeat_timeout_s}: a starting "
                "engine pauses longer than a serving one"
            )
        if self.response_cache_mb and not self.response_cache_models:
            raise ValueError(
                f"response_cache_mb {self.response_cache_mb} caches nothing until "
                "response_cache_models names the models whose answers it may keep (or * for "
                "every model); or set response_cache_mb to 0"
            )
        if any(size > self.max_batch_size for size in self.warmup_batch_sizes):
            raise ValueError(
                f"warmup_batch_sizes {self.warmup_batch_sizes} must not exceed "
                f"max_batch_size {self.max_batch_size}"
            )
        return self

    @property
    def shutdown_grace_s(self) -> int:
        """How long a stopping process waits for the requests it holds: the longest a queued
        request can still take (its deadline), plus a margin to answer it."""
        return math.ceil(self.request_timeout_ms / 1000) + SHUTDOWN_MARGIN_S


_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_MODEL_ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_-]{0,63})(?:@(latest|[0-9a-f]{12}))?$")


def _model_and_version(entry: str) -> tuple[str, str]:
    """``name`` or ``name@version`` as (name, version); ``latest`` when no version is named."""
    match = _MODEL_ENTRY.match(entry)
    if match is None:
        raise ValueError(
            f"each model is a name or name@version (version: latest or 12 hex characters), "
            f"got {entry!r}"
        )
    return match.group(1), match.group(2) or "latest"


class SettingsError(Exception):
    """Settings that failed validation, rendered with the environment variable names."""


def load_settings(**overrides: object) -> Settings:
    """Build settings from the environment plus explicit overrides (command-line flags).

    Raises ``SettingsError`` whose message names every bad variable, its value and what is
    accepted, so the process can print it and exit instead of showing a traceback.
    """
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as error:
        raise SettingsError(describe_validation_error(error)) from None


def describe_validation_error(error: ValidationError) -> str:
    lines = ["invalid batchserve settings:"]
    for problem in error.errors():
        field = "__".join(str(part) for part in problem["loc"])
        variable = ENV_PREFIX + field.upper() if field else "settings"
        value = problem.get("input")
        secret = "token" in field.lower()
        shown = "" if isinstance(value, dict) or secret else f" = {value!r}"
        lines.append(f"  {variable}{shown}: {problem['msg']}")
    return "\n".join(lines)
