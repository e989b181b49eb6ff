"""The slot KV cache and the inputs of a forward over rows of different lengths."""

from __future__ import annotations

import pytest
import torch

from service.engine.generation.forward_inputs import Row, forward_inputs
from service.engine.generation.kv_cache import KVLayout, SlotKVCache, slots_for_budget

CPU = torch.device("cpu")
LAYOUT = KVLayout(heads=(2, 2), key_dims=(3, 3), value_dims=(3, 3), dtype=torch.float32, device=CPU)


def test_rows_are_left_padded_with_their_own_positions_and_masks() -> None:
    inputs = forward_inputs([Row(slot=0, start=5, token_ids=[7]), Row(2, 0, [1, 2, 3])], CPU)

    assert inputs.input_ids.tolist() == [[0, 0, 7], [1, 2, 3]]
    assert inputs.position_ids.tolist() == [[5, 5, 5], [0, 1, 2]]
    mask = inputs.attention_mask.int()
    assert mask.shape == (2, 1, 3, 6)
    # The decode row sees its 5 cached tokens and itself; its padding sees the same.
    assert mask[0, 0].tolist() == [[1, 1, 1, 1, 1, 1]] * 3
    # The prefill row is causal within its chunk, and never sees past its own tokens.
    assert mask[1, 0].tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
    ]
    plan = inputs.plan
    assert plan.write_slots.tolist() == [0, 2, 2, 2]
    assert plan.write_positions.tolist() == [5, 0, 1, 2]
    assert plan.write_rows.tolist() == [0, 1, 1, 1]
    assert plan.write_columns.tolist() == [2, 0, 1, 2]
    assert isinstance(plan.read_slots, torch.Tensor)
    assert plan.read_slots.tolist() == [0, 2]
    assert plan.read_tokens == 6


def test_rows_in_the_first_slots_in_order_are_read_as_a_slice() -> None:
    inputs = forward_inputs([Row(0, 3, [1]), Row(1, 8, [2])], CPU)
    assert inputs.plan.read_slots == slice(0, 2)
    with pytest.raises(ValueError, match="at least one row"):
        forward_inputs([], CPU)
    with pytest.raises(ValueError, match="each with at least one token"):
        forward_inputs([Row(0, 0, [])], CPU)


def test_update_writes_each_row_at_its_positions_and_reads_views() -> None:
    cache = SlotKVCache(LAYOUT, slots=3, tokens_per_slot=8)
    inputs = forward_inputs([Row(0, 2, [1]), Row(1, 0, [1])], CPU)
    cache.plan = inputs.plan
    new_keys = torch.arange(2 * 2 * 1 * 3, dtype=torch.float32).view(2, 2, 1, 3) + 1
    keys, values = cache.update(new_keys, -new_keys, layer_idx=0)

    stored = cache.layers[0].keys
    assert stored is not None
    assert torch.equal(stored[0, :, 2], new_keys[0, :, 0])
    assert torch.equal(stored[1, :, 0], new_keys[1, :, 0])
    assert keys.shape == (2, 2, 3, 3)
    assert keys.data_ptr() == stored.data_ptr()  # a view of slots 0 and 1
    assert torch.equal(values[1, :, 0], -new_keys[1, :, 0])


def test_move_swap_and_clear_work_on_every_layer() -> None:
    cache = SlotKVCache(LAYOUT, slots=3, tokens_per_slot=4)
    for layer in cache.layers:
        assert layer.keys is not None
        assert layer.values is not None
        for slot in range(3):
            layer.keys[slot].fill_(slot + 1)
            layer.values[slot].fill_(-(slot + 1))

    cache.swap(0, 2, first_tokens=4, second_tokens=4)
    cache.move(1, 0, tokens=2)
    cache.clear(1)

    for layer in cache.layers:
        assert layer.keys is not None
        assert layer.keys[0, :, :2].eq(2).all()
        assert layer.keys[0, :, 2:].eq(3).all()
        assert layer.keys[1].eq(0).all()
        assert layer.keys[2].eq(1).all()
    assert cache.bytes == 2 * 2 * (3 * 2 * 4 * 3 * 4)


def test_the_budget_sets_the_slots_and_each_model_knows_its_token_size() -> None:
    assert LAYOUT.bytes_per_token == 2 * 2 * (3 + 3) * 4
    assert slots_for_budget(LAYOUT, budget_bytes=96 * 100 * 5 + 1, tokens_per_slot=100) == 5
    with pytest.raises(ValueError, match="at least one slot of one token, got 0 slot"):
        SlotKVCache(LAYOUT, slots=0, tokens_per_slot=8)
    cache = SlotKVCache(LAYOUT, slots=1, tokens_per_slot=8)
    with pytest.raises(RuntimeError, match="plan must be set"):
        cache.update(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3), layer_idx=0)
