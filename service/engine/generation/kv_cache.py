"""The KV cache of a continuous batch: a slot per running sequence, allocated once.

Each layer holds keys and values of shape ``[slots, kv_heads, tokens_per_slot, head_dim]``.
A sequence holds one slot from its first prefill to its last token; each row of a forward
writes its new keys and values at its own positions, so sequences of any lengths share a
forward. The sequences that decode sit in slots ``0..n-1`` (the owner moves the last one into
a slot freed below it), so a decode step reads ``keys[:n, :, :length]``: views, not copies.
Prefill rows may sit anywhere and are gathered.

``SlotKVCache`` is a ``transformers`` ``Cache`` built on its public ``Cache`` and
``CacheLayerMixin``: the model calls ``update`` per layer as it calls a ``DynamicCache``'s.
What it cannot tell the model is each row's length, so a forward over it needs explicit
``position_ids`` and a 4-D attention mask (``forward_inputs.py``); ``masking_utils`` uses a 4-D
mask as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache


@dataclass(frozen=True)
class KVLayout:
    """The keys and values one token takes in each layer, as the model computes them."""

    heads: tuple[int, ...]
    """Key/value heads per layer."""
    key_dims: tuple[int, ...]
    value_dims: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        per_layer = zip(self.heads, self.key_dims, self.value_dims, strict=True)
        return sum(heads * (key + value) * element for heads, key, value in per_layer)


def probe_kv_layout(model: torch.nn.Module) -> KVLayout:
    """Run ``model`` on one token with a ``DynamicCache`` and read the shapes and dtype of
    what it cached: no per-architecture config names to know (``n_head`` or
    ``num_key_value_heads``, ``head_dim``)."""
    device = next(model.parameters()).device
    probe = DynamicCache()
    token = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.inference_mode():
        model(input_ids=token, cache=probe, use_cache=True)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in probe.layers:
        if (
            isinstance(layer, CacheLayerMixin)
            and layer.keys is not None
            and layer.values is not None
        ):
            keys.append(layer.keys)
            values.append(layer.values)
    if not keys or len(keys) != len(probe.layers):
        raise ValueError(
            f"{type(model).__name__} did not fill a transformers Cache passed as `cache=` "
            "(each of its layers needs keys and values; `cache` is the argument's name in "
            "transformers 5.24, the version tested)"
        )
    return KVLayout(
        heads=tuple(int(key.shape[1]) for key in keys),
        key_dims=tuple(int(key.shape[-1]) for key in keys),
        value_dims=tuple(int(value.shape[-1]) for value in values),
        dtype=keys[0].dtype,
        device=keys[0].device,
    )


def slots_for_budget(layout: KVLayout, budget_bytes: int, tokens_per_slot: int) -> int:
    """How many slots of ``tokens_per_slot`` tokens fit in ``budget_bytes``."""
    return budget_bytes // (layout.bytes_per_token * tokens_per_slot)


@dataclass(frozen=True)
class ForwardPlan:
    """Where one forward writes its new keys and values, and what attention reads back.

    Each new token ``j`` (row ``write_rows[j]``, column ``write_columns[j]`` of the forward's
    input) is stored in slot ``write_slots[j]`` at position ``write_positions[j]``. Attention
    reads ``read_tokens`` positions of the slots ``read_slots`` (a slice: a view; a tensor
    of slot indices: gathered), one per row of the forward, in order.
    """

    write_slots: torch.Tensor
    write_positions: torch.Tensor
    write_rows: torch.Tensor
    write_columns: torch.Tensor
    read_slots: slice | torch.Tensor
    read_tokens: int


class _SlotLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # transformers' hook
    """One layer's slots; writes and reads as the owning cache's current plan says."""

    def __init__(self, owner: SlotKVCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._owner = owner
        self.keys: torch.Tensor = keys
        self.values: torch.Tensor = values
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocated up front by the owning cache: nothing to do."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._owner.plan
        slots, positions = plan.write_slots, plan.write_positions
        if key_states.shape[2] == 1:
            # A decode step: one new token per row, every row written in order.
            new_keys, new_values = key_states[:, :, 0], value_states[:, :, 0]
        else:
            rows, columns = plan.write_rows, plan.write_columns
            new_keys, new_values = key_states[rows, :, columns], value_states[rows, :, columns]
        self.keys[slots, :, positions] = new_keys.to(self.keys.dtype)
        self.values[slots, :, positions] = new_values.to(self.values.dtype)
        tokens = plan.read_tokens
        return self.keys[plan.read_slots, :, :tokens], self.values[plan.read_slots, :, :tokens]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.plan.read_tokens, 0

    def get_seq_length(self) -> int:
        raise NotImplementedError(
            "rows of a SlotKVCache have lengths of their own: pass position_ids and a 4-D "
            "attention mask"
        )

    def get_max_length(self) -> int:
        return int(self.keys.shape[2])


class SlotKVCache(Cache):
    """Keys and values for ``slots`` sequences of up to ``tokens_per_slot`` tokens each, in
    every layer of ``layout``. ``plan`` must be set before each forward."""

    def __init__(self, layout: KVLayout, slots: int, tokens_per_slot: int) -> None:
        if slots < 1 or tokens_per_slot < 1:
            raise ValueError(
                f"a KV cache needs at least one slot of one token, got {slots} slot(s) of "
                f"{tokens_per_slot} token(s)"
            )
        self.slots = slots
        self.tokens_per_slot = tokens_per_slot
        self._plan: ForwardPlan | None = None
        layers: list[Any] = []
        per_layer = zip(layout.heads, layout.key_dims, layout.value_dims, strict=True)
        for heads, key_dim, value_dim in per_layer:
            shape = (slots, heads, tokens_per_slot)
            keys = torch.zeros((*shape, key_dim), dtype=layout.dtype, device=layout.device)
            values = torch.zeros((*shape, value_dim), dtype=layout.dtype, device=layout.device)
            layers.append(_SlotLayer(self, keys, values))
        super().__init__(layers=layers)

    @property
    def plan(self) -> ForwardPlan:
        if self._plan is None:
            raise RuntimeError("SlotKVCache.plan must be set before a forward")
        return self._plan

    @plan.setter
    def plan(self, plan: ForwardPlan) -> None:
        self._plan = plan

    @property
    def bytes(self) -> int:
        """What the cache's tensors take on the device."""
        return sum(
            layer.keys.nbytes + layer.values.nbytes
            for layer in self.layers
            if isinstance(layer, _SlotLayer)
        )

    def move(self, source: int, target: int, tokens: int) -> None:
        """Copy the first ``tokens`` positions of slot ``source`` into slot ``target``."""
        for layer in self._slot_layers():
            layer.keys[target, :, :tokens] = layer.keys[source, :, :tokens]
            layer.values[target, :, :tokens] = layer.values[source, :, :tokens]

    def clear(self, slot: int) -> None:
        """Zero a slot. Attention reads the stale tail of a slot masked, but a masked NaN
        still makes NaN: a slot that held non-finite values is cleared before reuse."""
        for layer in self._slot_layers():
            layer.keys[slot].zero_()
            layer.values[slot].zero_()

    def swap(self, first: int, second: int, first_tokens: int, second_tokens: int) -> None:
        """Exchange the contents of two slots (their first ``*_tokens`` positions)."""
        for layer in self._slot_layers():
            for tensor in (layer.keys, layer.values):
                kept = tensor[first, :, :first_tokens].clone()
                tensor[first, :, :second_tokens] = tensor[second, :, :second_tokens]
                tensor[second, :, :first_tokens] = kept

    def _slot_layers(self) -> list[_SlotLayer]:
        return [layer for layer in self.layers if isinstance(layer, _SlotLayer)]
