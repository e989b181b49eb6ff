"""The inputs of one forward over rows of different lengths: ids, positions, the 4-D mask, and
where the new keys and values go in the slot cache.

Rows are left-padded to the longest, so every row's last token is the forward's last column
and ``logits_to_keep=1`` computes the logits of exactly those. Each query sees its own row's
cached positions up to its own (causal within a prefill chunk) and nothing else, whatever
stale keys sit further along its slot. Padding columns are never written to the cache; they
see their row's first new position so that no query row is fully masked (it would give NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.engine.generation.kv_cache import ForwardPlan


@dataclass(frozen=True)
class Row:
    """One sequence's part of a forward: ``token_ids`` fed at positions ``start``,
    ``start + 1``, ... of slot ``slot`` (``start`` tokens of it are cached already)."""

    slot: int
    start: int
    token_ids: Sequence[int]


@dataclass(frozen=True)
class ForwardInputs:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    """Boolean, ``[rows, 1, columns, read_tokens]``: True where a query may attend."""
    plan: ForwardPlan


def forward_inputs(rows: Sequence[Row], device: torch.device) -> ForwardInputs:
    """The tensors of one forward over ``rows``, on ``device``. Rows in slots ``0..n-1`` in
    order read their keys and values as a view, any others gathered."""
    if not rows or any(not row.token_ids for row in rows):
        raise ValueError("a forward needs at least one row, each with at least one token")
    columns = max(len(row.token_ids) for row in rows)
    ids: list[list[int]] = []
    positions: list[list[int]] = []
    writes: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    for index, row in enumerate(rows):
        padding = columns - len(row.token_ids)
        ids.append([0] * padding + list(row.token_ids))
        own = range(row.start, row.start + len(row.token_ids))
        positions.append([row.start] * padding + list(own))
        for column, position in enumerate(own, start=padding):
            for destination, value in zip(writes, (row.slot, position, index, column), strict=True):
                destination.append(value)
    read_tokens = max(row.start + len(row.token_ids) for row in rows)
    slots = [row.slot for row in rows]
    read_slots: slice | torch.Tensor = (
        slice(0, len(rows))
        if slots == list(range(len(rows)))
        else torch.tensor(slots, device=device)
    )
    position_ids = torch.tensor(positions, device=device)
    seen = torch.arange(read_tokens, device=device)
    mask = seen.view(1, 1, 1, -1) <= position_ids.view(len(rows), 1, columns, 1)
    write_slots, write_positions, write_rows, write_columns = (
        torch.tensor(values, device=device) for values in writes
    )
    plan = ForwardPlan(
        write_slots, write_positions, write_rows, write_columns, read_slots, read_tokens
    )
    return ForwardInputs(
        input_ids=torch.tensor(ids, device=device),
        position_ids=position_ids,
        attention_mask=mask,
        plan=plan,
    )
