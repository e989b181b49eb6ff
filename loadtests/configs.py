"""The workloads (what the clients send) and the named server configurations of the sweep.

A configuration is a set of ``BATCHSERVE_*`` variables for ``batchserve serve`` plus the
workload sent to it. Configurations whose model or settings this checkout does not have yet
are reported as unavailable, with the reason, instead of silently measuring something else
(pydantic-settings ignores unknown ``BATCHSERVE_*`` variables).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loadtests import bodies

IMAGE_MODEL_NAME = "tinyimage"
IMAGE_ARCHITECTURE = "service.models.image:TinyImageClassifier"
COMPILED_READY_TIMEOUT_S = 900.0
#: Settings that shape batching or the queue, not one forward pass: the model limit of two
#: configurations differing only in these is measured once.
NOT_AFFECTING_FORWARD = frozenset(
    {
        "BATCHSERVE_BATCH_POLICY",
        "BATCHSERVE_MAX_WAIT_MS",
        "BATCHSERVE_MAX_QUEUE_SIZE",
        "BATCHSERVE_LENGTH_BUCKETS",
        "BATCHSERVE_MAX_BATCH_TOKENS",
        "BATCHSERVE_REQUEST_TIMEOUT_MS",
    }
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
    needs_image_repository: bool = False

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
    make_bodies=lambda rng: bodies.digits_bodies(rng, 64),
)


def textenc_fixed_length(length: int) -> Workload:
    """Every request ``length`` token ids: one bucket, so batching alone is measured."""
    return Workload(
        name=f"textenc-{length}",
        model_name="textenc",
        description=f"{length} token ids as JSON",
        make_bodies=lambda rng: bodies.token_bodies(rng, [length] * 64),
        limit_length=length,
    )


TEXTENC_128 = textenc_fixed_length(128)
TEXTENC_16 = textenc_fixed_length(16)
TEXTENC_MIXED = Workload(
    name="textenc-mixed",
    model_name="textenc",
    description="8-512 token ids (log-uniform) as JSON",
    make_bodies=lambda rng: bodies.token_bodies(rng, bodies.token_lengths_log_uniform(rng, 256)),
    # The distribution's mean length is about 121: a server that never padded would pay
    # roughly the per-row cost of length 128.
    limit_length=128,
)
IMAGE_JSON = Workload(
    name="image-json",
    model_name=IMAGE_MODEL_NAME,
    description="one 3x224x224 float32 image as JSON, JSON answer",
    make_bodies=lambda rng: bodies.image_json_bodies(rng, 4),
    needs_image_repository=True,
)
IMAGE_NPY = Workload(
    name="image-npy",
    model_name=IMAGE_MODEL_NAME,
    description="one 3x224x224 float32 image as .npy, .npy answer",
    make_bodies=lambda rng: bodies.image_npy_bodies(rng, 4),
    content_type=bodies.NPY_MEDIA_TYPE,
    accept=bodies.NPY_MEDIA_TYPE,
    needs_image_repository=True,
)

_TEXTENC = {"BATCHSERVE_MODEL_NAME": "textenc"}
_IMAGE = {"BATCHSERVE_MODEL_NAME": IMAGE_MODEL_NAME}

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
    )
}


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


def unavailable_reason(configuration: Configuration, repository: Path) -> str | None:
    """Why this checkout cannot serve ``configuration`` as described, or None if it can."""
    from service.config import ENV_PREFIX, Settings

    fields = set(Settings.model_fields)
    for variable in configuration.env:
        name = variable.removeprefix(ENV_PREFIX).lower()
        if name not in fields:
            return (
                f"{variable} is not a batchserve setting in this checkout "
                f"(service.config.Settings has no field {name!r} yet)"
            )
    for name in configuration.requires_settings:
        if name not in fields:
            return f"service.config.Settings has no field {name!r} yet"
    if configuration.workload.needs_image_repository:
        return None  # checked when the repository is packaged
    model = configuration.workload.model_name
    # A plain look at the folder: importing the model store would import torch here.
    if not any((repository / model).glob("*/manifest.json")):
        return f"model {model!r} is not in the repository {repository} yet"
    return None


def package_image_model(root: Path, seed: int = 0) -> Path:
    """Package TinyImageClassifier with seeded weights into a new repository at ``root``.

    Raises RuntimeError with the reason if the architecture does not exist in this checkout.
    """
    import torch
    from safetensors.torch import save_file

    from service.errors import ModelLoadError
    from service.model_store import Architecture, ModelStore, TensorSpec, instantiate

    architecture = Architecture(import_path=IMAGE_ARCHITECTURE)
    torch.manual_seed(seed)
    try:
        module = instantiate(architecture)
    except ModelLoadError as error:
        raise RuntimeError(f"{IMAGE_ARCHITECTURE} is not available: {error}") from None
    root.mkdir(parents=True, exist_ok=True)
    weights = root / "tinyimage.safetensors"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(weights))
    repository = root / "models"
    ModelStore(repository).package(
        name=IMAGE_MODEL_NAME,
        artifact=weights,
        format="safetensors",
        architecture=architecture,
        inputs=(TensorSpec(name="image", dtype="float32", shape=(-1, *bodies.IMAGE_SHAPE)),),
        outputs=(TensorSpec(name="logits", dtype="float32", shape=(-1, 10)),),
        metadata={"purpose": "load tests; random seeded weights"},
    )
    return repository
