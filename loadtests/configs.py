"""The workloads (what the clients send) and the named server configurations of the sweep.

A workload's request bodies are pre-generated and seeded, so inputs vary from request to
request and the same sweep sends the same bodies; one instance per request. A configuration
is a set of ``BATCHSERVE_*`` variables for ``batchserve serve`` plus the workload sent to it.
Configurations whose model or settings this checkout does not have yet are reported as
unavailable, with the reason, instead of silently measuring something else (pydantic-settings
ignores unknown ``BATCHSERVE_*`` variables).
"""

from __future__ import annotations

import fnmatch
import io
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

NPY_MEDIA_TYPE = "application/x-npy"
TOKEN_ID_RANGE = (1, 999)  # 0 is padding
IMAGE_SHAPE = (3, 224, 224)
MLP_FEATURES = 256
COMPILED_READY_TIMEOUT_S = 900.0
WORKERS_VARIABLE = "BATCHSERVE_WORKERS"
ENGINE_MODE_VARIABLE = "BATCHSERVE_ENGINE_MODE"
#: Settings that shape batching, the queue or the processes around the model, not one forward
#: pass: the model limit of two configurations differing only in these is measured once.
NOT_AFFECTING_FORWARD = frozenset(
    {
        "BATCHSERVE_BATCH_POLICY",
        "BATCHSERVE_MAX_WAIT_MS",
        "BATCHSERVE_MAX_QUEUE_SIZE",
        "BATCHSERVE_LENGTH_BUCKETS",
        "BATCHSERVE_MAX_BATCH_TOKENS",
        "BATCHSERVE_REQUEST_TIMEOUT_MS",
        WORKERS_VARIABLE,
        ENGINE_MODE_VARIABLE,
    }
)


def _json(instance: object) -> bytes:
    return orjson.dumps({"instances": [instance]})


def digits_bodies(rng: np.random.Generator, count: int) -> list[bytes]:
    """8x8 pixel intensities in [0, 1] on scikit-learn's 1/16 grid, like the real digits."""
    return [_json((rng.integers(0, 17, size=(8, 8)) / 16).tolist()) for _ in range(count)]


def mlp_bodies(rng: np.random.Generator, count: int) -> list[bytes]:
    """256 standard-normal float32 features, 4 decimals (about 2 kB per body)."""
    return [
        _json(rng.standard_normal(MLP_FEATURES, dtype=np.float32).round(4).tolist())
        for _ in range(count)
    ]


def token_lengths_log_uniform(
    rng: np.random.Generator, count: int, low: int = 8, high: int = 512
) -> list[int]:
    """Lengths drawn log-uniformly from ``low`` to ``high`` inclusive (mean about 121 for 8-512)."""
    logs = rng.uniform(math.log(low), math.log(high + 1), size=count)
    return [min(high, max(low, int(math.exp(value)))) for value in logs]


def token_bodies(rng: np.random.Generator, lengths: list[int]) -> list[bytes]:
    """One JSON list of token ids in 1..999 per body, of the given lengths."""
    low, high = TOKEN_ID_RANGE
    return [_json(rng.integers(low, high + 1, size=length).tolist()) for length in lengths]


def image_array(rng: np.random.Generator) -> np.ndarray:
    return rng.random(IMAGE_SHAPE, dtype=np.float32)


def image_json_bodies(rng: np.random.Generator, count: int) -> list[bytes]:
    """A 3x224x224 float32 image as nested JSON lists (4 decimals: about 1 MB per body)."""
    return [_json(image_array(rng).round(4).tolist()) for _ in range(count)]


def image_npy_bodies(rng: np.random.Generator, count: int) -> list[bytes]:
    """``np.save`` bytes of a (1, 3, 224, 224) float32 array (about 600 kB per body)."""
    bodies = []
    for _ in range(count):
        buffer = io.BytesIO()
        np.save(buffer, image_array(rng)[np.newaxis], allow_pickle=False)
        bodies.append(buffer.getvalue())
    return bodies


@dataclass(frozen=True)
class PackagedModel:
    """A model the sweep packages itself, with seeded weights, into a temporary repository.

    The architecture is an import path, so any checkout that has the module (this one, or a
    ``--baseline-checkout``) can build it from the same manifest and weights.
    """

    name: str
    architecture: str
    """``module:Class`` of the ``nn.Module``."""
    input_name: str
    instance_shape: tuple[int, ...]
    classes: int = 10

    def module_file(self, checkout: Path) -> Path:
        """Where ``checkout`` must have the architecture's module."""
        module = self.architecture.split(":", 1)[0]
        return checkout.joinpath(*module.split(".")).with_suffix(".py")

    def package(self, root: Path, seed: int = 0) -> Path:
        """Package the architecture with weights from ``torch.manual_seed(seed)`` into a new
        repository under ``root``; returns the repository. The same seed gives the same weights,
        so the same version id.

        Raises RuntimeError with the reason if the architecture does not exist in this checkout.
        """
        from datetime import UTC, datetime

        import torch
        from safetensors.torch import save_file

        from service.engine.model_store import instantiate
        from service.errors import ModelLoadError
        from service.manifest import ARTIFACT_SUFFIXES, Architecture, Manifest, TensorSpec
        from service.packaging.package import Packager

        architecture = Architecture(import_path=self.architecture)
        inputs = (
            TensorSpec(name=self.input_name, dtype="float32", shape=(-1, *self.instance_shape)),
        )
        outputs = (TensorSpec(name="logits", dtype="float32", shape=(-1, self.classes)),)
        # The version to be packaged, but for the weights' hash (not written yet): what the
        # architecture is imported for. It bundles no module, so the import is the installed one.
        artifact_name = "model" + ARTIFACT_SUFFIXES["safetensors"]
        draft = Manifest.create(
            name=self.name,
            format="safetensors",
            artifact=artifact_name,
            files={artifact_name: "0" * 64},
            architecture=architecture,
            inputs=inputs,
            outputs=outputs,
            created_at=datetime.now(UTC),
        )
        torch.manual_seed(seed)
        try:
            module = instantiate(architecture, draft, root)
        except ModelLoadError as error:
            raise RuntimeError(f"{self.architecture} is not available: {error}") from None
        root.mkdir(parents=True, exist_ok=True)
        weights = root / f"{self.name}.safetensors"
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(weights))
        repository = root / "models"
        Packager(repository).package(
            name=self.name,
            artifact=weights,
            format="safetensors",
            architecture=architecture,
            inputs=inputs,
            outputs=outputs,
            metadata={"purpose": f"load tests; random weights, torch.manual_seed({seed})"},
        )
        return repository


IMAGE_MODEL = PackagedModel(
    name="tinyimage",
    architecture="service.models.image:TinyImageClassifier",
    input_name="image",
    instance_shape=IMAGE_SHAPE,
)
MLP_MODEL = PackagedModel(
    name="mlp",
    architecture="service.models.mlp:PeerMLP",
    input_name="features",
    instance_shape=(MLP_FEATURES,),
)


@dataclass(frozen=True)
class Workload:
    """What the clients send: one instance per request, drawn from pre-generated bodies."""

    name: str
    model_name: str
    description: str
    make_bodies: Callable[[np.random.Generator], list[bytes]]
    content_type: str = "application/json"
    accept: str | None = None
    limit_length: int | None = None
    """Length of the variable axes in the model-limit measurement (token sequences)."""
    packaged: PackagedModel | None = None
    """The model, when the sweep packages it into a temporary repository itself."""

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": self.content_type}
        if self.accept is not None:
            headers["Accept"] = self.accept
        return headers

    def bodies(self, seed: int = 0) -> list[bytes]:
        return self.make_bodies(np.random.default_rng(seed))


@dataclass(frozen=True)
class Configuration:
    name: str
    workload: Workload
    description: str
    env: Mapping[str, str] = field(default_factory=dict)
    requires_settings: tuple[str, ...] = ()
    """Settings fields the configuration depends on even when it leaves them at the default."""
    ready_timeout_s: float = 120.0
    heavy: bool = False
    """Slow to start (torch.compile): left out by ``--skip-heavy``."""

    def model_limit_key(self) -> tuple[object, ...]:
        forward_env = sorted(
            (key, value) for key, value in self.env.items() if key not in NOT_AFFECTING_FORWARD
        )
        return (self.workload.model_name, self.workload.limit_length, tuple(forward_env))


DIGITS = Workload(
    name="digits",
    model_name="digits",
    description="one 8x8 digit as JSON",
    make_bodies=lambda rng: digits_bodies(rng, 64),
)


def textenc_fixed_length(length: int) -> Workload:
    """Every request ``length`` token ids: one bucket, so batching alone is measured."""
    return Workload(
        name=f"textenc-{length}",
        model_name="textenc",
        description=f"{length} token ids as JSON",
        make_bodies=lambda rng: token_bodies(rng, [length] * 64),
        limit_length=length,
    )


TEXTENC_128 = textenc_fixed_length(128)
TEXTENC_16 = textenc_fixed_length(16)
TEXTENC_MIXED = Workload(
    name="textenc-mixed",
    model_name="textenc",
    description="8-512 token ids (log-uniform) as JSON",
    make_bodies=lambda rng: token_bodies(rng, token_lengths_log_uniform(rng, 256)),
    # The distribution's mean length is about 121: a server that never padded would pay
    # roughly the per-row cost of length 128.
    limit_length=128,
)
MLP = Workload(
    name="mlp",
    model_name=MLP_MODEL.name,
    description="256 float32 features as JSON",
    make_bodies=lambda rng: mlp_bodies(rng, 64),
    packaged=MLP_MODEL,
)
IMAGE_JSON = Workload(
    name="image-json",
    model_name=IMAGE_MODEL.name,
    description="one 3x224x224 float32 image as JSON, JSON answer",
    make_bodies=lambda rng: image_json_bodies(rng, 4),
    packaged=IMAGE_MODEL,
)
IMAGE_NPY = Workload(
    name="image-npy",
    model_name=IMAGE_MODEL.name,
    description="one 3x224x224 float32 image as .npy, .npy answer",
    make_bodies=lambda rng: image_npy_bodies(rng, 4),
    content_type=NPY_MEDIA_TYPE,
    accept=NPY_MEDIA_TYPE,
    packaged=IMAGE_MODEL,
)

_TEXTENC = {"BATCHSERVE_MODEL_NAME": "textenc"}
_IMAGE = {"BATCHSERVE_MODEL_NAME": IMAGE_MODEL.name}
_MLP = {"BATCHSERVE_MODEL_NAME": MLP_MODEL.name}
_TWO_WORKERS = {WORKERS_VARIABLE: "2"}

CONFIGURATIONS: dict[str, Configuration] = {
    c.name: c
    for c in (
        Configuration("digits-batched", DIGITS, "defaults (batches up to 64 rows)"),
        Configuration(
            "digits-unbatched", DIGITS, "max_batch_size=1", {"BATCHSERVE_MAX_BATCH_SIZE": "1"}
        ),
        Configuration(
            "digits-fixed-wait",
            DIGITS,
            "batch_policy=fixed (always waits max_wait_ms for batch-mates)",
            {"BATCHSERVE_BATCH_POLICY": "fixed"},
        ),
        Configuration("digits-bf16", DIGITS, "bf16 autocast", {"BATCHSERVE_PRECISION": "bf16"}),
        Configuration(
            "digits-compiled",
            DIGITS,
            "torch.compile mode default",
            {"BATCHSERVE_COMPILE_MODE": "default"},
            ready_timeout_s=COMPILED_READY_TIMEOUT_S,
            heavy=True,
        ),
        Configuration("textenc-128-batched", TEXTENC_128, "textenc defaults", _TEXTENC),
        Configuration(
            "textenc-128-unbatched",
            TEXTENC_128,
            "textenc, max_batch_size=1",
            _TEXTENC | {"BATCHSERVE_MAX_BATCH_SIZE": "1"},
        ),
        Configuration("textenc-16-batched", TEXTENC_16, "textenc defaults, 16 tokens", _TEXTENC),
        Configuration(
            "textenc-16-unbatched",
            TEXTENC_16,
            "textenc, 16 tokens, max_batch_size=1",
            _TEXTENC | {"BATCHSERVE_MAX_BATCH_SIZE": "1"},
        ),
        Configuration(
            "textenc-mixed-buckets",
            TEXTENC_MIXED,
            "textenc, mixed lengths, default length buckets (powers of two)",
            _TEXTENC,
            requires_settings=("length_buckets",),
        ),
        Configuration(
            "textenc-mixed-pad-longest",
            TEXTENC_MIXED,
            "textenc, mixed lengths, one bucket: pad to the batch's longest",
            # One edge as a JSON list: pydantic-settings reads a bare "512" as a number, which
            # the tuple field refuses.
            _TEXTENC | {"BATCHSERVE_LENGTH_BUCKETS": "[512]"},
        ),
        Configuration(
            "textenc-128-bf16",
            TEXTENC_128,
            "textenc, bf16 autocast",
            _TEXTENC | {"BATCHSERVE_PRECISION": "bf16"},
        ),
        Configuration(
            "textenc-128-bf16-unbatched",
            TEXTENC_128,
            "textenc, bf16 autocast, max_batch_size=1",
            _TEXTENC | {"BATCHSERVE_PRECISION": "bf16", "BATCHSERVE_MAX_BATCH_SIZE": "1"},
        ),
        Configuration(
            "textenc-128-compiled",
            TEXTENC_128,
            "textenc, torch.compile mode default",
            _TEXTENC | {"BATCHSERVE_COMPILE_MODE": "default"},
            ready_timeout_s=COMPILED_READY_TIMEOUT_S,
            heavy=True,
        ),
        Configuration("image-json", IMAGE_JSON, "TinyImageClassifier, JSON in and out", _IMAGE),
        Configuration("image-npy", IMAGE_NPY, "TinyImageClassifier, .npy in and out", _IMAGE),
        Configuration("mlp-single", MLP, "PeerMLP, one process (the default for one worker)", _MLP),
        Configuration(
            "mlp-w1-process",
            MLP,
            "PeerMLP, one front end and one engine process",
            _MLP | {WORKERS_VARIABLE: "1", ENGINE_MODE_VARIABLE: "process"},
        ),
        Configuration("mlp-w2", MLP, "PeerMLP, workers=2", _MLP | _TWO_WORKERS),
        Configuration(
            "mlp-w2-fixed-wait",
            MLP,
            "PeerMLP, workers=2, batch_policy=fixed",
            _MLP | _TWO_WORKERS | {"BATCHSERVE_BATCH_POLICY": "fixed"},
        ),
        Configuration(
            "mlp-w2-batch32",
            MLP,
            "PeerMLP, workers=2, max_batch_size=32",
            _MLP | _TWO_WORKERS | {"BATCHSERVE_MAX_BATCH_SIZE": "32"},
        ),
        Configuration(
            "mlp-w2-threads2",
            MLP,
            "PeerMLP, workers=2, torch_threads=2",
            _MLP | _TWO_WORKERS | {"BATCHSERVE_TORCH_THREADS": "2"},
        ),
        Configuration(
            "mlp-w2-i2-b32",
            MLP,
            "PeerMLP, workers=2, two instances, max_batch_size=32",
            _MLP
            | _TWO_WORKERS
            | {"BATCHSERVE_DEVICE_INSTANCES": "2", "BATCHSERVE_MAX_BATCH_SIZE": "32"},
        ),
        Configuration(
            "mlp-w3",
            MLP,
            "PeerMLP, workers=3 (more front ends than cores)",
            _MLP | {WORKERS_VARIABLE: "3"},
        ),
        Configuration(
            "mlp-w4",
            MLP,
            "PeerMLP, workers=4 (twice as many front ends as cores)",
            _MLP | {WORKERS_VARIABLE: "4"},
        ),
        Configuration("digits-w2", DIGITS, "digits, workers=2", _TWO_WORKERS),
        Configuration(
            "mlp-w2-instances2",
            MLP,
            "PeerMLP, workers=2, two model instances in the engine (torch threads split)",
            _MLP | _TWO_WORKERS | {"BATCHSERVE_DEVICE_INSTANCES": "2"},
            requires_settings=("device_instances",),
        ),
    )
}

#: Pairs (a, b) of configurations compared by an interleaved sweep (``--interleave``) as the
#: ratio a / b per round, when both are selected: what gunicorn front ends or an engine
#: process cost or bring against one process serving alone.
COMPARISONS: tuple[tuple[str, str], ...] = (
    ("mlp-w2", "mlp-single"),
    ("digits-w2", "digits-batched"),
    ("mlp-w1-process", "mlp-single"),
    ("mlp-w2-instances2", "mlp-w2"),
)


def select(patterns: Sequence[str], *, skip_heavy: bool = False) -> list[Configuration]:
    """Configurations matching any of ``patterns`` (names or shell globs), in table order."""
    unknown = [p for p in patterns if not fnmatch.filter(CONFIGURATIONS, p)]
    if unknown:
        raise ValueError(f"no configuration matches {unknown}; known: {', '.join(CONFIGURATIONS)}")
    chosen = [
        c
        for name, c in CONFIGURATIONS.items()
        if any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]
    return [c for c in chosen if not (skip_heavy and c.heavy)]


def front_ends(env: Mapping[str, str]) -> int:
    """gunicorn front ends a server with ``env`` runs; 0 when it serves in one process.

    The server's rule (``service.server.cli.serves_in_one_process``) read from the variables,
    for one device: several GPUs with ``device`` auto would also give front ends.
    """
    workers = int(env.get(WORKERS_VARIABLE, "1"))
    mode = env.get(ENGINE_MODE_VARIABLE, "auto")
    if mode == "in_process" or (mode == "auto" and workers == 1):
        return 0
    return workers


def ceiling_label(front_end_count: int) -> str:
    """The HTTP ceiling's name: ``http-ceiling`` for one process, ``http-ceiling-wN`` for N
    gunicorn front ends."""
    return "http-ceiling" if front_end_count == 0 else f"http-ceiling-w{front_end_count}"


def missing_setting(
    configuration: Configuration, settings_fields: Collection[str], where: str = "this checkout"
) -> str | None:
    """Which setting ``configuration`` needs that a checkout with ``settings_fields`` lacks."""
    from service.config import ENV_PREFIX

    for variable in configuration.env:
        name = variable.removeprefix(ENV_PREFIX).lower()
        if name not in settings_fields:
            return (
                f"{variable} is not a batchserve setting in {where} "
                f"(service.config.Settings has no field {name!r})"
            )
    for name in configuration.requires_settings:
        if name not in settings_fields:
            return f"service.config.Settings in {where} has no field {name!r}"
    return None


def unavailable_reason(
    configuration: Configuration,
    repository: Path,
    *,
    settings_fields: Collection[str] | None = None,
    checkout: Path | None = None,
) -> str | None:
    """Why a checkout cannot serve ``configuration`` as described, or None if it can.

    ``settings_fields`` are the checkout's settings (default: this one's); ``checkout`` is
    another checkout's root, whose files a packaged model's architecture must be found in.
    """
    from service.config import Settings

    fields = frozenset(Settings.model_fields) if settings_fields is None else settings_fields
    where = "this checkout" if checkout is None else str(checkout)
    reason = missing_setting(configuration, fields, where)
    if reason is not None:
        return reason
    packaged = configuration.workload.packaged
    if packaged is not None:
        if checkout is not None and not packaged.module_file(checkout).is_file():
            missing = packaged.module_file(checkout)
            return (
                f"{missing} does not exist, so {packaged.architecture} cannot be built there: "
                f"copy {missing.relative_to(checkout)} from this checkout"
            )
        return None  # this checkout's architecture is checked when the model is packaged
    model = configuration.workload.model_name
    # A plain look at the folder: importing the model store would import torch here.
    if not any((repository / model).glob("*/manifest.json")):
        return f"model {model!r} is not in the repository {repository} yet"
    return None
