"""What ``batchserve package`` reads: a version's spec from flags and a JSON file.

``NAME:DTYPE:SHAPE[:KEY=VALUE...]`` describes a tensor on the command line; a spec file (JSON)
holds the same fields as the manifest, minus what packaging computes (version, hashes,
creation time). Flags override the file's fields. ``check_handler`` builds the handler once,
as a front end will, before the version is written.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from service.errors import ModelLoadError
from service.frontend.handlers.base import HandlerContext, build_handler
from service.frontend.inputs import InputLayout
from service.manifest import Architecture, HandlerSpec, Manifest, ModelFormat, TensorSpec
from service.repository import one_line

_NUMBER_KEYS = ("min_value", "max_value", "pad_value", "default_value")


def tensor_spec(text: str) -> TensorSpec:
    """``input_ids:int64:-1,-1:max_length=128:pad_value=0`` -> a ``TensorSpec``."""
    parts = text.split(":")
    if len(parts) < 3:
        raise ValueError(
            f"a tensor is NAME:DTYPE:SHAPE[:KEY=VALUE...] (e.g. image:float32:-1,8,8), got {text!r}"
        )
    name, dtype, shape_text, *options = parts
    try:
        shape = tuple(int(size) for size in shape_text.split(","))
    except ValueError:
        raise ValueError(
            f"{name}: a shape is comma-separated integers with -1 for the batch and a variable "
            f"axis, got {shape_text!r}"
        ) from None
    fields: dict[str, Any] = {"name": name, "dtype": dtype, "shape": shape}
    for option in options:
        key, separator, value = option.partition("=")
        if not separator or key in fields:
            raise ValueError(f"{name}: options are KEY=VALUE, each once, got {option!r}")
        if key == "max_length":
            fields[key] = int(value)
        elif key in _NUMBER_KEYS:
            fields[key] = float(value)
        elif key == "labels":
            fields[key] = tuple(value.split(","))
        elif key == "length_of":
            fields[key] = value
        else:
            raise ValueError(
                f"{name}: unknown option {key!r}; the options are max_length, min_value, "
                "max_value, pad_value, labels and length_of"
            )
    return TensorSpec.model_validate(fields)


@dataclass(frozen=True)
class PackageSpec:
    """Everything ``package`` needs, from a spec file and flags; ``None``: not given."""

    name: str | None = None
    artifact: Path | None = None
    format: ModelFormat | None = None
    architecture: Architecture | None = None
    inputs: tuple[TensorSpec, ...] | None = None
    outputs: tuple[TensorSpec, ...] | None = None
    handler: HandlerSpec | None = None
    files: tuple[Path, ...] | None = None
    metadata: dict[str, Any] | None = None

    @classmethod
    def from_file(cls, path: Path) -> PackageSpec:
        """A spec file: JSON; relative paths are relative to the file's folder."""
        try:
            document = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError) as error:
            raise ValueError(f"cannot read the spec file {path.name}: {error}") from None
        if not isinstance(document, dict):
            raise ValueError(f"the spec file {path.name} must hold a JSON object")
        known = {field for field in cls.__dataclass_fields__}
        unknown = sorted(set(document) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown} in {path.name}; known: {sorted(known)}")
        folder = path.parent

        def located(value: str) -> Path:
            return folder / value

        return cls(
            name=document.get("name"),
            artifact=located(document["artifact"]) if "artifact" in document else None,
            format=document.get("format"),
            architecture=(
                Architecture.model_validate(document["architecture"])
                if document.get("architecture")
                else None
            ),
            inputs=(
                tuple(TensorSpec.model_validate(spec) for spec in document["inputs"])
                if "inputs" in document
                else None
            ),
            outputs=(
                tuple(TensorSpec.model_validate(spec) for spec in document["outputs"])
                if "outputs" in document
                else None
            ),
            handler=(
                HandlerSpec.model_validate(document["handler"]) if document.get("handler") else None
            ),
            files=tuple(located(name) for name in document["files"])
            if "files" in document
            else None,
            metadata=document.get("metadata"),
        )

    def overridden(self, **flags: Any) -> PackageSpec:
        """This spec with every flag that was given (not None) in place of its field."""
        return replace(self, **{key: value for key, value in flags.items() if value is not None})

    def required(self) -> tuple[str, Path, ModelFormat]:
        """Name, artifact and format, which have no default; and inputs and outputs."""
        missing = [
            flag
            for flag, value in (
                ("--name", self.name),
                ("--artifact", self.artifact),
                ("--format", self.format),
                ("--input", self.inputs),
                ("--output", self.outputs),
            )
            if not value
        ]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (as flags or in --spec)")
        assert self.name is not None
        assert self.artifact is not None
        assert self.format is not None
        return self.name, self.artifact, self.format


def unreadable_files(artifact: Path, files: tuple[Path, ...]) -> list[str]:
    """What is wrong with each path to package that is not a readable file, in words."""
    problems = []
    for path in (artifact, *files):
        if not path.exists():
            problems.append(f"{path} does not exist")
        elif not path.is_file():
            problems.append(f"{path} is not a file")
    return problems


def check_handler(manifest: Manifest, folder: Path) -> None:
    """Build the version's handler as a front end will, from ``folder``; raise
    ``ModelLoadError`` saying why it cannot be built."""
    if manifest.handler is None:
        return
    context = HandlerContext(manifest=manifest, folder=folder, layout=InputLayout(manifest))
    try:
        build_handler(context)
    except Exception as error:
        raise ModelLoadError(
            f"{manifest.label}: the handler cannot be built: {one_line(error)}"
        ) from error
