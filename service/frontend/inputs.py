"""Decode ``/predict`` bodies (JSON, ``.npy`` or ``.npz``) and validate them against the
model's input specs.

Everything a client can get wrong is caught here, before queuing, so one bad request can never
reach a batch and fail its batch-mates. Messages say what was expected and what was received.
``TensorLayout`` checks one tensor; ``InputLayout`` a model's named inputs. The result is one
array per input of shape (instances, *instance shape); variable-length instances are padded
with each spec's ``pad_value`` to the request's longest one, and inputs with a variable axis
(token ids and their mask) must have the same length for each instance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.errors import (
    BadRequestError,
    InvalidInputError,
    UnsupportedMediaTypeError,
)
from service.frontend.bodies import (
    JSON_MEDIA_TYPE,
    NPY_MEDIA_TYPE,
    NPZ_MEDIA_TYPE,
    json_type,
    npz_members,
    read_instances,
)
from service.frontend.optional_inputs import fill_defaults
from service.frontend.per_token import padded_instances
from service.frontend.tensor_layout import TensorLayout
from service.manifest import Manifest
from service.tensors import NamedArrays
from service.types import Array


@dataclass(frozen=True)
class InputLayout:
    """How requests for one model are parsed into its named inputs and validated (the engine
    groups them for batches: ``buckets.batch_group``)."""

    manifest: Manifest
    length_edges: tuple[int, ...] = ()
    max_instances: int = 1024

    def __post_init__(self) -> None:
        tensors = {
            spec.name: TensorLayout(spec, self.length_edges, self.max_instances)
            for spec in self.manifest.inputs
        }
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(self, "only", next(iter(tensors.items())) if len(tensors) == 1 else None)

    tensors: dict[str, TensorLayout] = field(init=False, repr=False, compare=False)
    only: tuple[str, TensorLayout] | None = field(init=False, repr=False, compare=False)
    """The name and layout of a model's one input (None with several): read per request."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.manifest.inputs)

    def parse(self, body: bytes, media_type: str) -> NamedArrays:
        """The body as the model's named inputs: JSON, one ``.npy`` array (a model with one
        input) or an ``.npz`` archive with one array per input name."""
        if media_type == NPY_MEDIA_TYPE:
            if len(self.tensors) > 1:
                raise InvalidInputError(
                    f"this model takes {len(self.tensors)} inputs {list(self.names)}: send them "
                    f"as one {NPZ_MEDIA_TYPE} archive with an array per name, or as JSON"
                )
            name = self.names[0]
            return NamedArrays({name: self.tensors[name].parse_npy(body)})
        if media_type == NPZ_MEDIA_TYPE:
            return self.parse_npz(body)
        if media_type != JSON_MEDIA_TYPE:
            raise UnsupportedMediaTypeError(
                f"this model reads {JSON_MEDIA_TYPE}, {NPY_MEDIA_TYPE} or {NPZ_MEDIA_TYPE} "
                f"bodies, got {media_type!r}"
            )
        return self.parse_json(body)

    def parse_json(self, body: bytes) -> NamedArrays:
        """``{"instances": [...]}``: each instance the bare value of a one-input model, or an
        object keyed by input name."""
        only = self.only
        if only is not None and only[1].plain_shape is not None:
            plain = only[1].parse_plain_json(body)
            if plain is not None:
                return NamedArrays.of_rows({only[0]: plain})
        instances = read_instances(body)
        if only is not None and not (instances and isinstance(instances[0], dict)):
            name, tensor = only
            # One array, validated to its spec's rank (at least the batch axis): one row count.
            parsed = NamedArrays.of_rows({name: tensor.parse_instances(instances, body)})
            axis = tensor.variable_axis
            if axis is None:
                return parsed
            return self._with_own_lengths(
                parsed, [_length(value, axis) or 0 for value in instances]
            )
        # Counted first, as one input's instances are: without any there is no column to count.
        self.tensors[self.names[0]].check_count(len(instances))
        columns: dict[str, list[Any]] = {name: [] for name in self.names}
        for index, instance in enumerate(instances):
            if not isinstance(instance, dict):
                raise InvalidInputError(
                    f"instance {index} must be an object keyed by input name "
                    f"{list(self.names)}, got {json_type(instance)}"
                )
            if self.required <= instance.keys() <= columns.keys() and (
                instance.keys() != instances[0].keys()
            ):
                raise InvalidInputError(
                    f"every instance must give the same inputs: instance 0 gives "
                    f"{sorted(instances[0])}, instance {index} {sorted(instance)}"
                )
            if not self.required <= instance.keys() <= columns.keys():
                missing = sorted(self.required - instance.keys())
                unknown = sorted(instance.keys() - columns.keys())
                raise InvalidInputError(
                    f"instance {index} must have exactly the inputs {list(self.names)}; "
                    + "; ".join(
                        text
                        for text in (
                            f"missing {missing}" if missing else "",
                            f"unknown {unknown}" if unknown else "",
                        )
                        if text
                    )
                )
            for name, value in instance.items():
                columns[name].append(value)
        columns = {name: column for name, column in columns.items() if column}
        self._check_shared_lengths(columns)
        arrays = {
            name: self.tensors[name].parse_instances(column, body)
            for name, column in columns.items()
        }
        variable = next(
            (name for name in columns if self.tensors[name].spec.variable_axis is not None), None
        )
        lengths = (
            [
                _length(value, self.tensors[variable].spec.variable_axis or 0) or 0
                for value in columns[variable]
            ]
            if variable is not None
            else None
        )
        filled = NamedArrays(self.filled(arrays, lengths))
        return self._with_own_lengths(self._checked_lengths(filled), lengths)

    @property
    def required(self) -> frozenset[str]:
        """The inputs a request must send: those without a ``default_value``."""
        return frozenset(spec.name for spec in self.manifest.inputs if spec.default_value is None)

    def filled(
        self, arrays: Mapping[str, Array], lengths: Sequence[int] | None = None
    ) -> dict[str, Array]:
        """``arrays`` with the optional inputs left out filled (``optional_inputs``)."""
        return fill_defaults(self.manifest.inputs, arrays, lengths)

    def parse_npz(self, body: bytes) -> NamedArrays:
        """An ``.npz`` archive (``np.savez``, no pickles) with one array per input name."""
        members = npz_members(body, self.tensors[self.names[0]].max_body_bytes(body))
        if not self.required <= members.keys() <= set(self.names):
            raise InvalidInputError(
                f"the .npz archive must hold exactly the arrays {list(self.names)}, "
                f"got {sorted(members)}"
            )
        arrays = {}
        for name in (name for name in self.names if name in members):
            try:
                arrays[name] = self.tensors[name].parse_npy(members[name])
            except (InvalidInputError, BadRequestError) as error:
                raise type(error)(f"input {name!r}: {error.message}") from None
        counts = {name: len(array) for name, array in arrays.items()}
        if len(set(counts.values())) > 1:
            raise InvalidInputError(f"every input needs one row per instance, got {counts}")
        return self._checked_lengths(NamedArrays(self.filled(arrays)))

    def check(self, arrays: Mapping[str, Array]) -> NamedArrays:
        """Validate named arrays a handler built against the input specs (dtype, shape,
        length, range) and return them as the request's inputs; optional inputs left out are
        filled with their default."""
        arrays = self.filled(arrays)
        if arrays.keys() != set(self.names):
            raise InvalidInputError(
                f"the handler built inputs {sorted(arrays)}; the model takes {list(self.names)}"
            )
        checked = {}
        for name in self.names:
            tensor = self.tensors[name]
            array = np.asarray(arrays[name])
            if array.dtype != tensor.spec.numpy_dtype:
                raise InvalidInputError(
                    f"input {name!r} must be {tensor.spec.dtype}, got {array.dtype.name}"
                )
            tensor.check_count(len(array) if array.ndim else 0)
            checked[name] = tensor.validated(np.ascontiguousarray(array))
        counts = {name: len(array) for name, array in checked.items()}
        if len(set(counts.values())) > 1:
            raise InvalidInputError(f"every input needs one row per instance, got {counts}")
        return self._checked_lengths(NamedArrays(checked))

    def _check_shared_lengths(self, columns: dict[str, list[Any]]) -> None:
        """Inputs with a variable axis (ids and mask) must be as long as each other, instance
        by instance, before they are padded."""
        variable = [
            (name, self.tensors[name].spec.variable_axis)
            for name in columns
            if self.tensors[name].spec.variable_axis is not None
        ]
        if len(variable) < 2:
            return
        for index in range(len(columns[variable[0][0]])):
            lengths = {name: _length(columns[name][index], axis or 0) for name, axis in variable}
            if None not in lengths.values() and len(set(lengths.values())) > 1:
                raise InvalidInputError(
                    f"instance {index}: inputs with a variable axis must be equally long, "
                    f"got lengths {lengths}"
                )

    def _with_own_lengths(self, arrays: NamedArrays, lengths: Sequence[int] | None) -> NamedArrays:
        """The parsed instances with each one's own length (``lengths``: of the variable
        inputs, when some are shorter than the longest): per-token outputs answer each at its
        length (``per_token``)."""
        if lengths is None:
            return arrays
        return padded_instances(arrays, lengths, self.manifest.inputs)

    def _checked_lengths(self, arrays: NamedArrays) -> NamedArrays:
        lengths = {
            name: arrays[name].shape[spec.variable_axis + 1]
            for name, spec in ((name, self.tensors[name].spec) for name in self.names)
            if spec.variable_axis is not None
        }
        if len(set(lengths.values())) > 1:
            raise InvalidInputError(
                f"inputs with a variable axis must be equally long, got lengths {lengths}"
            )
        return arrays


def _length(value: Any, axis: int) -> int | None:
    """The length of nested lists ``value`` along ``axis`` (None when it is not that deep:
    the tensor's own validation then says what shape it needed)."""
    for _ in range(axis):
        if not isinstance(value, list) or not value:
            return None
        value = value[0]
    return len(value) if isinstance(value, list) else None
