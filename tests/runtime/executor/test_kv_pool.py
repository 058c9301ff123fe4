"""The KV slot allocator and pool: no slot lost, none freed twice, clear errors."""

from __future__ import annotations

import pytest
import torch

from spruce.runtime.errors import SpruceError
from spruce.runtime.executor.kv_pool import (
    KVPool,
    KVShape,
    OutOfSlotsError,
    SlotAllocator,
    dequantize_int8,
    pool_slots_for_budget,
    quantize_int8,
)


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


def test_int8_rows_round_trip_within_half_a_step():
    """Each row's scale is its max |x| / 127: the extreme maps to +-127 exactly, every value
    comes back within half a scale step, and a zero row stays zero (scale 1, no NaN)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 10
    x[7, 1] = 0
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (50, 3)
    assert int(q.abs().amax(-1).min()) == 0 and bool((q.abs().amax(-1)[scale != 1] == 127).all())
    back = dequantize_int8(q, scale, torch.float32)
    assert bool(((back - x).abs() <= scale[..., None] / 2 * (1 + 1e-6)).all())
    assert scale[7, 1] == 1 and bool((back[7, 1] == 0).all())


def test_int8_pool_writes_reads_and_counts_its_scales():
    shape = KVShape(num_layers=2, kv_heads=3, head_dim=64, dtype=torch.int8)
    assert shape.bytes_per_slot == 2 * 2 * 3 * (64 + 4)  # int8 values and a float32 scale per row
    assert shape.bytes_per_slot / KVShape(2, 3, 64, torch.float16).bytes_per_slot == pytest.approx(
        0.53, abs=0.01
    )
    pool = KVPool(shape, num_slots=20)
    slots = pool.alloc(5)
    k, v = torch.randn(5, 3, 64), torch.randn(5, 3, 64)
    pool.write(1, slots, k, v)
    got_k, got_v = pool.read(1, slots.view(1, 5), torch.float32)
    assert got_k.shape == (1, 5, 3, 64)
    torch.testing.assert_close(got_k[0], k, atol=k.abs().max().item() / 127, rtol=0)
    torch.testing.assert_close(got_v[0], v, atol=v.abs().max().item() / 127, rtol=0)
    assert pool.scales(1)[0].shape == (20, 3) and pool.scales(0)[0] is not pool.scales(1)[0]
    assert KVPool(KVShape(2, 3, 64, torch.float16), 20).scales(0) is None
