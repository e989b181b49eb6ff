"""How far a candidate version's answer is from the served version's, on the same input.

Shadow traffic (``engine/shadow.py``) runs a share of a model's requests on a candidate version
too and compares the two answers here, row by row, in the engine where both are. Each output
is compared by what it is (``output_kind``):

- class scores (an output with ``labels``): the two agree on a row when their argmax (the
  label a classification handler answers) is the same;
- per-token class scores (``labels`` and ``length_of``): agreement is the share of a row's
  tokens whose argmax is the same, and a row agrees only when all of them do;
- integer outputs (token ids, label ids): exact equality, token by token;
- any other tensor: the largest absolute difference over the row, any shape; the row agrees
  when it is within ``atol``.

Generated text is compared by its token ids (``same_tokens``). Pure numpy, no state but the
bounded ``DisagreementLog``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from service.manifest import TensorSpec
from service.types import Array

OutputKind = Literal["class_scores", "token_scores", "exact", "tensor"]

#: Two float outputs this close (absolute) on every element agree: float32 round-off between
#: two batch compositions stays far below it, a changed weight does not.
DEFAULT_ATOL = 1e-4


def output_kind(spec: TensorSpec) -> OutputKind:
    """How an output is compared: by argmax when it has labels (per token when its variable
    axis follows an input's), exactly when it holds integers, else by absolute difference."""
    if spec.labels is not None:
        return "token_scores" if spec.length_of is not None else "class_scores"
    if not spec.dtype.startswith(("float", "bfloat")):  # bool and integers
        return "exact"
    return "tensor"


@dataclass(frozen=True, slots=True)
class RowComparison:
    """One row of one output, served against candidate."""

    agreed: bool
    max_abs_diff: float
    """The largest absolute difference of any element (``inf`` when the shapes differ)."""
    token_agreement: float
    """The share of positions (tokens; 1 for a row without tokens) that agree."""


def compare_row(served: Array, candidate: Array, kind: OutputKind, atol: float) -> RowComparison:
    """Compare one row of an output (the batch axis already taken off)."""
    if served.shape != candidate.shape:
        return RowComparison(agreed=False, max_abs_diff=math.inf, token_agreement=0.0)
    if served.size == 0:
        return RowComparison(agreed=True, max_abs_diff=0.0, token_agreement=1.0)
    diff = float(np.max(np.abs(served.astype(np.float64) - candidate.astype(np.float64))))
    if math.isnan(diff):
        diff = math.inf
    if kind == "class_scores":
        agreed = bool(np.argmax(served) == np.argmax(candidate))
        return RowComparison(agreed, diff, 1.0 if agreed else 0.0)
    if kind == "token_scores":
        same = np.argmax(served, axis=-1) == np.argmax(candidate, axis=-1)
        share = float(np.mean(same))
        return RowComparison(bool(same.all()), diff, share)
    if kind == "exact":
        same = served == candidate
        share = float(np.mean(same)) if served.ndim else float(same)
        return RowComparison(bool(np.all(same)), diff, share)
    agreed = diff <= atol
    return RowComparison(agreed, diff, 1.0 if agreed else 0.0)


@dataclass(frozen=True, slots=True)
class AnswerComparison:
    """One request's answer, served against candidate: per row, whether every output agreed,
    and the first output (in manifest order) that did not, with its figures."""

    rows: int
    disagreeing_rows: tuple[int, ...]
    max_abs_diff: float
    """The largest over every output and row."""
    token_agreement: float
    """The mean over every output and row."""
    first_disagreement: str | None
    """``"<output> row <i>: ..."``, for the disagreement log; None when all agreed."""

    @property
    def agreed(self) -> bool:
        return not self.disagreeing_rows


def compare_answers(
    served: Mapping[str, Array],
    candidate: Mapping[str, Array],
    specs: Mapping[str, TensorSpec],
    atol: float = DEFAULT_ATOL,
) -> AnswerComparison:
    """Compare two answers to one request, output by output and row by row. ``specs``: the
    served version's outputs; an output the candidate lacks disagrees on every row."""
    rows = min((len(array) for array in served.values()), default=0)
    disagreeing: set[int] = set()
    max_diff = 0.0
    shares: list[float] = []
    first: str | None = None
    for name, spec in specs.items():
        if name not in served:
            continue
        kind = output_kind(spec)
        theirs = candidate.get(name)
        for row in range(rows):
            if theirs is None or row >= len(theirs):
                result = RowComparison(False, math.inf, 0.0)
            else:
                result = compare_row(served[name][row], theirs[row], kind, atol)
            max_diff = max(max_diff, result.max_abs_diff)
            shares.append(result.token_agreement)
            if not result.agreed:
                disagreeing.add(row)
                if first is None:
                    first = (
                        f"{name} row {row}: {kind}, max |diff| {result.max_abs_diff:.6g}, "
                        f"token agreement {result.token_agreement:.3f}"
                    )
    return AnswerComparison(
        rows=rows,
        disagreeing_rows=tuple(sorted(disagreeing)),
        max_abs_diff=max_diff,
        token_agreement=float(np.mean(shares)) if shares else 1.0,
        first_disagreement=first,
    )


def same_tokens(served: tuple[int, ...], candidate: tuple[int, ...]) -> RowComparison:
    """Two generations of one greedy prompt: they agree when their token ids are the same;
    ``token_agreement`` is the share of positions of the longer one that match."""
    length = max(len(served), len(candidate))
    if length == 0:
        return RowComparison(True, 0.0, 1.0)
    matching = sum(1 for a, b in zip(served, candidate, strict=False) if a == b)
    agreed = served == candidate
    return RowComparison(agreed, 0.0 if agreed else math.inf, matching / length)


@dataclass(frozen=True, slots=True)
class Disagreement:
    """One request on which the candidate disagreed, as the disagreement log keeps it."""

    model: str
    served_version: str
    candidate_version: str
    request_id: str
    detail: str

    def to_json(self) -> dict[str, str]:
        return {
            "model": self.model,
            "served_version": self.served_version,
            "candidate_version": self.candidate_version,
            "request_id": self.request_id,
            "detail": self.detail,
        }


class DisagreementLog:
    """The last ``capacity`` disagreements (a ring buffer): bounded whatever the traffic."""

    def __init__(self, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"a disagreement log holds at least 1 entry, got {capacity}")
        self._entries: deque[Disagreement] = deque(maxlen=capacity)

    def add(self, entry: Disagreement) -> None:
        self._entries.append(entry)

    def entries(self) -> list[Disagreement]:
        """Oldest first."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
