"""Small fixed-weight ``nn.Module``s whose outputs are known exactly.

They live in an importable module so a packaged version can name them as its architecture,
e.g. ``tests.torch_models:AffineModel``.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from service.manifest import Architecture, TensorSpec
from service.models.digits import DigitsCNN
from service.packaging.package import Packager
from service.processes import ENGINE_INDEX_ENV

FEATURES = 4


class AffineModel(nn.Module):
    """(N, features) -> scale * x + shift, through an ``nn.Linear`` with set weights.

    With the defaults it computes exactly ``2x + 1`` in fp32 for inputs whose doubles are
    representable (small integers, quarters): the weight is ``2 * I`` and the bias is ``1``.
    """

    def __init__(self, features: int = FEATURES, scale: float = 2.0, shift: float = 1.0) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)
        with torch.no_grad():
            self.linear.weight.copy_(scale * torch.eye(features))
            self.linear.bias.fill_(shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.linear(x)
        return output


class RaisesOnNegative(nn.Module):
    """Returns ``2x + 1``, but raises ``ValueError`` when any input value is negative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x < 0).any()):
            raise ValueError("RaisesOnNegative got a negative input")
        return 2 * x + 1


class ThreadRecorder(nn.Module):
    """Returns ``2x + 1`` and records, per call, the thread and the autocast/inference state."""

    def __init__(self) -> None:
        super().__init__()
        self.thread_names: list[str] = []
        self.autocast_dtypes: list[torch.dtype | None] = []
        self.inference_mode: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.thread_names.append(threading.current_thread().name)
        autocast = torch.is_autocast_enabled(x.device.type)
        self.autocast_dtypes.append(torch.get_autocast_dtype(x.device.type) if autocast else None)
        self.inference_mode.append(torch.is_inference_mode_enabled())
        return 2 * x + 1


class TupleModel(nn.Module):
    """Returns a tuple of two tensors, ``(x, 2x)``: answered when the manifest declares two
    outputs, refused when it declares another count."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, 2 * x


class DoubledRowsModel(nn.Module):
    """Returns twice as many rows as it was given: a broken model the runner must refuse."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x])


class OutOfMemoryAbove(nn.Module):
    """Returns ``2x + 1``, but raises ``torch.OutOfMemoryError`` (as CUDA does) for batches of
    more than ``max_rows`` rows: device-memory exhaustion, simulated on the CPU."""

    def __init__(self, max_rows: int = 2) -> None:
        super().__init__()
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            raise torch.OutOfMemoryError(f"simulated: {x.shape[0]} rows > {self.max_rows}")
        return 2 * x + 1


#: Set to let every ``HangsOnValue`` forward that is blocked return.
HANG_RELEASE = threading.Event()
#: Set by a ``HangsOnValue`` forward once it blocks: the device thread is then held. Cleared
#: by the tests that wait on it, before they start.
HANG_ENTERED = threading.Event()
HANG_VALUE = 13.0


class HangsOnValue(nn.Module):
    """Returns ``2x + 1``, but blocks like a deadlocked kernel while any input equals
    ``HANG_VALUE``, until ``HANG_RELEASE`` is set (or 60 s pass, so no test can hang CI)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == HANG_VALUE).any()):
            HANG_ENTERED.set()
            HANG_RELEASE.wait(timeout=60)
        return 2 * x + 1


#: The order in which the ``Recorded*`` models ran their forwards, by model name (on the
#: device thread, so a test reads the device's order, not the order its clients resumed in).
FORWARD_ORDER: list[str] = []


class RecordedHangsOnValue(HangsOnValue):
    """``HangsOnValue`` that appends ``"slow"`` to ``FORWARD_ORDER`` at each forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FORWARD_ORDER.append("slow")
        return super().forward(x)


class RecordedAffine(AffineModel):
    """``AffineModel`` that appends ``"quick"`` to ``FORWARD_ORDER`` at each forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FORWARD_ORDER.append("quick")
        return super().forward(x)


class HangsWhileFileExists(nn.Module):
    """Returns ``2x + 1``, but blocks like a deadlocked kernel while any input equals
    ``HANG_VALUE`` and the file ``gate`` exists (at most 60 s): a hang that a test can end
    from another process, by deleting the file."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == HANG_VALUE).any()):
            deadline_s = time.monotonic() + 60
            while os.path.exists(self.gate) and time.monotonic() < deadline_s:
                time.sleep(0.01)
        return 2 * x + 1


class DigitsThatCannotLoadInTheSecondEngine(DigitsCNN):
    """The digits CNN, except that it cannot be built by the server's second engine: a
    version one device refuses, for the all-or-none switch across engines."""

    def __init__(self) -> None:
        if os.environ.get(ENGINE_INDEX_ENV) == "1":
            raise RuntimeError("this version cannot be built on the second device")
        super().__init__()


class OverflowsOnSeven(nn.Module):
    """Returns ``2x + 1``, but infinity in every row whose input contains 7: a model that
    overflows on some inputs (as fp16 autocast can), finite inputs or not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        overflowing = (x == 7).any(dim=1, keepdim=True)
        return torch.where(overflowing, torch.full_like(x, float("inf")), 2 * x + 1)


def package_hanging_model(repository: Path, gate: Path) -> None:
    """Package ``hangs`` (``HangsWhileFileExists`` on ``gate``, no weights) into
    ``repository``."""
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "empty.safetensors"
        save_file({}, str(weights))
        Packager(repository).package(
            name="hangs",
            artifact=weights,
            format="safetensors",
            architecture=Architecture(
                import_path="tests.torch_models:HangsWhileFileExists", kwargs={"gate": str(gate)}
            ),
            inputs=(TensorSpec(name="x", dtype="float32", shape=(-1, FEATURES)),),
            outputs=(TensorSpec(name="y", dtype="float32", shape=(-1, FEATURES)),),
        )


class PairClassifier(nn.Module):
    """HuggingFace-style: ``forward(input_ids, attention_mask)`` -> a dict with ``logits``
    (N, 3) float32 and ``label`` (N,) int64 (the argmax), over a masked mean of embeddings,
    so the padding a batch adds changes nothing."""

    def __init__(self, vocabulary: int = 100, width: int = 8) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embedding = nn.Embedding(vocabulary, width)
        self.head = nn.Linear(width, 3)
        with torch.no_grad():
            self.embedding.weight.copy_(torch.randn(vocabulary, width, generator=generator))
            self.head.weight.copy_(torch.randn(3, width, generator=generator))
            self.head.bias.zero_()

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        keep = attention_mask.unsqueeze(-1).to(torch.float32)
        pooled = (self.embedding(input_ids) * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        logits: torch.Tensor = self.head(pooled)
        return {"logits": logits, "label": logits.argmax(dim=-1)}


PAIR_INPUTS = (
    TensorSpec(
        name="input_ids", dtype="int64", shape=(-1, -1), max_length=32, min_value=1,
        max_value=99, pad_value=0,
    ),
    TensorSpec(
        name="attention_mask", dtype="int64", shape=(-1, -1), max_length=32, min_value=0,
        max_value=1, pad_value=0,
    ),
)  # fmt: skip
PAIR_OUTPUTS = (
    TensorSpec(name="logits", dtype="float32", shape=(-1, 3), labels=("a", "b", "c")),
    TensorSpec(name="label", dtype="int64", shape=(-1,)),
)


def package_pair_classifier(repository: Path, **changes: object) -> str:
    """Package ``PairClassifier`` as ``pairs`` (``changes`` replace package() arguments);
    returns the version."""
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "pairs.safetensors"
        save_file(dict(PairClassifier().state_dict()), str(weights))
        arguments: dict[str, object] = {
            "name": "pairs",
            "artifact": weights,
            "format": "safetensors",
            "architecture": Architecture(import_path="tests.torch_models:PairClassifier"),
            "inputs": PAIR_INPUTS,
            "outputs": PAIR_OUTPUTS,
            **changes,
        }
        return Packager(repository).package(**arguments).version  # type: ignore[arg-type]


class PaddingSensitiveEncoder(nn.Module):
    """A Transformer encoder with a key padding mask and 512 learned positions, like the
    models that failed warm-up: a row of padding only raises (attention over no key), and a
    sequence longer than 512 tokens is "index out of range"."""

    def __init__(self, vocabulary: int = 100, width: int = 16, positions: int = 512) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocabulary, width)
        self.positions = nn.Embedding(positions, width)
        layer = nn.TransformerEncoderLayer(width, 2, dim_feedforward=32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        padding = input_ids == 0
        if padding.all(dim=1).any():
            raise ValueError("a row holds padding only: attention has no key to attend to")
        where = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.tokens(input_ids) + self.positions(where)
        encoded = self.encoder(hidden, src_key_padding_mask=padding)
        pooled: torch.Tensor = encoded[:, 0]
        return pooled


class CharSum(nn.Module):
    """(N, L) int64 character codes -> (N,) their sum as float32 (padding is 0)."""

    def forward(self, chars: torch.Tensor) -> torch.Tensor:
        return chars.sum(dim=1).to(torch.float32)


class Eigenvalues(nn.Module):
    """(N, 2, 2) -> (N, 2) real parts of the eigenvalues: ``linalg.eigvals`` has no ONNX
    form, so exporting it to onnx must fail naming it."""

    def forward(self, matrices: torch.Tensor) -> torch.Tensor:
        values: torch.Tensor = torch.linalg.eigvals(matrices).real
        return values


TAG_CLASSES = 5


class TokenTagger(nn.Module):
    """(N, L) int64 token ids -> ``logits`` (N, L, classes) float32 and ``tags`` (N, L) int64,
    each position from its own token alone (an embedding lookup), so answers are checkable:
    with the default weights the logits of token ``t`` are ``-|c - t % classes|`` and its tag
    is ``t % classes``. Padding (id 0) gets real-looking tags (0), as a real tagger's would."""

    def __init__(self, vocabulary: int = 100, classes: int = TAG_CLASSES) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, classes)
        with torch.no_grad():
            tags = torch.arange(vocabulary).unsqueeze(1) % classes
            self.embedding.weight.copy_(-(torch.arange(classes) - tags).abs().to(torch.float32))

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        logits: torch.Tensor = self.embedding(input_ids)
        return {"logits": logits, "tags": logits.argmax(dim=-1)}


class MaskedTokenTagger(TokenTagger):
    """``TokenTagger`` taking the text handler's inputs (ids and attention mask)."""

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        return super().forward(input_ids)


#: How long ``SleepingDigits`` sleeps in each forward: many times a digits batch on a CPU.
SLEEPING_DIGITS_S = 0.03


class SleepingDigits(DigitsCNN):
    """The digits CNN, sleeping ``SLEEPING_DIGITS_S`` in every forward: a slow candidate."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEPING_DIGITS_S)
        return super().forward(images)


class RaisingDigits(DigitsCNN):
    """The digits CNN, raising on a batch holding a constant image (all pixels alike; the
    warm-up's random images never are): a candidate that fails."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        flat = images.flatten(1)
        if bool((flat.amax(dim=1) == flat.amin(dim=1)).any()):
            raise ValueError("RaisingDigits got a constant image")
        return super().forward(images)


class ThresholdClassifier(nn.Module):
    """(N, 1) values -> (N, 2) scores: ``high`` where the value is at least ``threshold`` (a
    buffer in the weights file), ``low`` elsewhere. Two versions that differ only in their
    threshold disagree exactly on the values between them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("threshold", torch.tensor([1000.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        high = (x >= self.threshold).to(torch.float32)
        return torch.cat([1.0 - high, high], dim=1)


def package_threshold_classifier(repository: Path, threshold: float) -> str:
    """Package ``ThresholdClassifier`` as ``threshold`` at ``threshold``; the version."""
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "threshold.safetensors"
        save_file({"threshold": torch.tensor([threshold])}, str(weights))
        return (
            Packager(repository)
            .package(
                name="threshold",
                artifact=weights,
                format="safetensors",
                architecture=Architecture(import_path="tests.torch_models:ThresholdClassifier"),
                inputs=(
                    TensorSpec(
                        name="x", dtype="float32", shape=(-1, 1), min_value=0, max_value=100
                    ),
                ),
                outputs=(
                    TensorSpec(
                        name="scores", dtype="float32", shape=(-1, 2), labels=("low", "high")
                    ),
                ),
            )
            .version
        )
