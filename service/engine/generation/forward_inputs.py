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
    """The tensors of one forward over ``rows``, on ``device`` (built on the host and copied
    over at once). Rows in slots ``0..n-1`` in order read their keys and values as a view,
    any others gathered."""
    if not rows or any(not row.token_ids for row in rows):
        raise ValueError("a forward needs at least one row, each with at least one token")
    columns = max(len(row.token_ids) for row in rows)
    ids: list[int] = []
    positions: list[int] = []
    write_slots: list[int] = []
    write_positions: list[int] = []
    write_rows: list[int] = []
    write_columns: list[int] = []
    for index, row in enumerate(rows):
        count = len(row.token_ids)
        padding = columns - count
        own = range(row.start, row.start + count)
        ids += [0] * padding
        ids += row.token_ids
        positions += [row.start] * padding
        positions += own
        write_slots += [row.slot] * count
        write_positions += own
        write_rows += [index] * count
        write_columns += range(padding, columns)
    slots = [row.slot for row in rows]
    contiguous = slots == list(range(len(rows)))
    values = torch.tensor(
        [*ids, *positions, *write_slots, *write_positions, *write_rows, *write_columns, *slots],
        dtype=torch.long,
    ).to(device)
    cells, written = len(ids), len(write_slots)
    parts = torch.split(values, [cells, cells, written, written, written, written, len(rows)])
    input_ids = parts[0].view(len(rows), columns)
    position_ids = parts[1].view(len(rows), columns)
    read_tokens = max(row.start + len(row.token_ids) for row in rows)
    seen = torch.arange(read_tokens, device=device)
    mask = seen.view(1, 1, 1, -1) <= position_ids.view(len(rows), 1, columns, 1)
    plan = ForwardPlan(
        write_slots=parts[2],
        write_positions=parts[3],
        write_rows=parts[4],
        write_columns=parts[5],
        read_slots=slice(0, len(rows)) if contiguous else parts[6],
        read_tokens=read_tokens,
    )
    return ForwardInputs(input_ids, position_ids, mask, plan)
