"""The V2 request parameters batchserve reads, type-checked: JSON's ``true`` is no number and
``"no"`` is no boolean.

Python counts ``True`` as the integer 1 and any non-empty string as true, so an unchecked
``timeout: true`` was a timeout of 1 µs and ``binary_data_output: "no"`` asked for binary
outputs. Each parameter here is refused with 400 unless it has the protocol's type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.errors import BadRequestError
from service.types import Priority


def flag(parameters: Mapping[str, Any], name: str, where: str, default: bool = False) -> bool:
    """A boolean parameter (``binary_data_output``, ``binary_data``); 400 for anything else."""
    value = parameters.get(name, default)
    if not isinstance(value, bool):
        raise BadRequestError(f"{name} of {where} must be true or false, got {value!r}")
    return value


def _whole_number(parameters: Mapping[str, Any], name: str) -> int | None:
    value = parameters.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequestError(f"'{name}' must be a non-negative integer, got {value!r}")
    return value


def timeout_us(parameters: Mapping[str, Any]) -> int | None:
    """Triton's ``timeout`` parameter, if given: a whole number of microseconds from 1 up
    (JSON or gRPC alike); 400 for anything else, with one message whatever was wrong."""
    value = parameters.get("timeout")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequestError(
            f"'timeout' must be a whole number of microseconds from 1 up, got {value!r}"
        )
    return value


#: The deadline's source when the request's ``timeout`` parameter set it (named by its 504).
TIMEOUT_PARAMETER = "the request's 'timeout' parameter"


def timeout_s(parameters: Mapping[str, Any]) -> float | None:
    """The ``timeout`` parameter in seconds: it may shorten the request's deadline."""
    timeout = timeout_us(parameters)
    return None if timeout is None else timeout / 1e6


def batch_priority(parameters: Mapping[str, Any], header: str | None = None) -> Priority:
    """Triton's ``priority`` parameter (1 is the highest level) or ``X-Priority: high``."""
    if _whole_number(parameters, "priority") == 1 or (header or "").strip().lower() == "high":
        return "high"
    return "normal"
