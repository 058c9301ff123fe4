"""The KV slot allocator and pool: no slot lost, none freed twice, clear errors."""

from __future__ import annotations

import pytest
import torch

from spruce.runtime.errors import SpruceError
from spruce.runtime.executor.kv_pool import KVShape, OutOfSlotsError, SlotAllocator, pool_slots_for_budget


def test_alloc_is_ascending_and_contiguous_when_fresh():
    pool = SlotAllocator(10)
    assert pool.alloc(4).tolist() == [1, 2, 3, 4]
    assert pool.alloc(2).tolist() == [5, 6]
    assert pool.num_free == 3


def test_free_then_alloc_reuses_slots_and_compact_sorts():
    pool = SlotAllocator(10)
    a = pool.alloc(6)
    pool.free(a[[4, 1]])
    assert sorted(pool.alloc(2).tolist()) == [2, 5]
    pool.free(a[:1])
    pool.compact()
    assert pool.alloc(4).tolist() == [1, 7, 8, 9]


def test_double_free_and_over_allocation_are_errors():
    pool = SlotAllocator(5)
    slots = pool.alloc(2)
    pool.free(slots)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(slots[:1])
    taken = pool.alloc(3)
    with pytest.raises(AssertionError, match="appears twice"):
        pool.free(taken[[0, 0]])
    with pytest.raises(AssertionError):
        pool.free(torch.tensor([0]))
    with pytest.raises(OutOfSlotsError, match="asked for 5 KV slots, 1 free"):
        pool.alloc(5)


def test_integrity_counts_held_slots():
    pool = SlotAllocator(8)
    held = pool.alloc(3)
    pool.check_integrity(held=3)
    with pytest.raises(AssertionError, match="slot leak"):
        pool.check_integrity(held=2)
    pool.free(held)
    pool.check_integrity(held=0)


def test_budget_sizing_and_clear_error():
    shape = KVShape(num_layers=2, kv_heads=2, head_dim=16, dtype=torch.float32)
    assert shape.bytes_per_slot == 2 * 2 * 2 * 16 * 4
    assert pool_slots_for_budget(shape, 512 * 100, min_slots=10) == 100
    with pytest.raises(SpruceError, match="raise --kv-memory-gb"):
        pool_slots_for_budget(shape, 512 * 5, min_slots=10)
