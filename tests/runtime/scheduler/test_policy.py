"""Waiting-queue policies return the order they promise (fcfs, lpm, dfs-weight), and the
scheduler admits in that order."""

from __future__ import annotations

import pytest
from scheduler_fakes import make_req, make_scheduler, run_to_end

from spruce.radix import RadixCache
from spruce.runtime.errors import SpruceError
from spruce.runtime.executor.kv_pool import SlotAllocator
from spruce.runtime.scheduler.policy import (
    POLICIES,
    dfs_weight,
    fcfs,
    get_policy,
    longest_prefix_match,
)

A = [1, 1, 1, 1, 1, 1]
B = [2, 2, 2, 2, 2, 2]


def cache_with(*sequences: list[int]) -> RadixCache:
    allocator = SlotAllocator(256)
    cache = RadixCache(allocator)
    for ids in sequences:
        cache.insert(ids, allocator.alloc(len(ids)))
    return cache


def test_fcfs_keeps_arrival_order():
    reqs = [make_req([9, i]) for i in range(5)]
    assert fcfs(reqs, cache_with(), 128) == reqs


def test_lpm_puts_the_longest_cached_prefix_first():
    cache = cache_with(A, B[:3])
    none, short, long = make_req([7, 7, 7]), make_req(B[:3] + [5]), make_req(A + [5])
    assert longest_prefix_match([none, short, long], cache, 128) == [long, short, none]


def test_lpm_and_dfs_fall_back_to_arrival_order_beyond_max_queue():
    cache = cache_with(A)
    reqs = [make_req([7, 7]), make_req(A + [5])]
    assert longest_prefix_match(reqs, cache, 1) == reqs
    assert dfs_weight(reqs, cache, 1) == reqs


def test_dfs_weight_groups_siblings_heaviest_subtree_first():
    cache = cache_with(A, B)
    a1, b1, a2, b2, b3 = (make_req(p + [i]) for i, p in enumerate([A, B, A, B, B]))
    order = dfs_weight([a1, b1, a2, b2, b3], cache, 128)
    assert order == [b1, b2, b3, a1, a2]  # B's subtree holds three requests, A's two


def test_the_scheduler_admits_in_policy_order():
    for name, expected in (("fcfs", [0, 1, 2]), ("lpm", [2, 1, 0])):
        scheduler = make_scheduler(schedule_policy=name, max_running_requests=3)
        warm = make_req(A + B, max_new_tokens=1)  # leaves A + B in the cache
        scheduler.add(warm)
        run_to_end(scheduler)
        reqs = [make_req([7] * 4), make_req(A + [8] * 4), make_req(A + B + [8] * 4)]
        for req in reqs:
            scheduler.add(req)
        out = scheduler.schedule()
        assert out.reqs == [reqs[i] for i in expected], name


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(SpruceError, match="fcfs, lpm, dfs-weight"):
        get_policy("random")
    assert set(POLICIES) == {"fcfs", "lpm", "dfs-weight"}


def test_policies_do_not_change_the_cache():
    cache = cache_with(A)
    before = cache.size_info()
    for policy in POLICIES.values():
        policy([make_req(A + [3]), make_req([4])], cache, 128)
    assert cache.size_info() == before
