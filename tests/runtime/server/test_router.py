"""Cache-aware routing over data-parallel replicas (no model: the policy alone)."""

from __future__ import annotations

import random

from spruce.runtime.scheduler.router import CacheAwareRouter, RoundRobinRouter, RouterOptions


def few_shot_workload(prefixes: int = 4, questions: int = 16, prefix_len: int = 200, seed: int = 0):
    rng = random.Random(seed)
    shots = [[rng.randrange(1000) for _ in range(prefix_len)] for _ in range(prefixes)]
    work = [
        shots[p] + [rng.randrange(1000) for _ in range(12)]
        for q in range(questions)
        for p in range(prefixes)
    ]
    rng.shuffle(work)
    return work


def hit_rate(router, work: list[list[int]], replicas: int) -> float:
    """Share of prompt tokens found in the replica's (exact, unbounded) cache of earlier prompts."""
    seen: list[list[list[int]]] = [[] for _ in range(replicas)]
    hits = total = 0
    for ids in work:
        replica = router.route(ids, [0] * replicas)
        hits += max((_common(ids, old) for old in seen[replica]), default=0)
        total += len(ids)
        seen[replica].append(ids)
    return hits / total


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_prefix_routing_keeps_the_single_replica_hit_rate_where_round_robin_loses_it():
    work = few_shot_workload()
    single = hit_rate(CacheAwareRouter(1), work, 1)
    cache_aware = hit_rate(CacheAwareRouter(2), work, 2)
    round_robin = hit_rate(RoundRobinRouter(2), work, 2)
    print(
        f"hit rate: 1 replica {single:.3f}, 2 cache-aware {cache_aware:.3f}, 2 round-robin {round_robin:.3f}"
    )
    assert cache_aware >= single - 0.05
    assert round_robin < cache_aware - 0.01
    assert cache_aware > 0.8


def test_prompts_sharing_a_prefix_land_on_the_same_replica_and_new_ones_spread():
    router = CacheAwareRouter(2)
    a = router.route([1, 2, 3, 4, 5, 6], [0, 0])
    assert router.route([1, 2, 3, 4, 5, 7], [0, 0]) == a  # 5 of 6 tokens cached there
    assert router.route([9, 9, 9, 9], [0, 0]) != a  # nothing cached: the emptier replica
    assert router.matched_lengths([1, 2, 3, 8]) == ([3, 0] if a == 0 else [0, 3])


def test_an_unbalanced_load_overrides_the_cache():
    router = CacheAwareRouter(2, RouterOptions(balance_abs_threshold=4, balance_rel_threshold=1.5))
    router.record(0, [1, 2, 3, 4])
    assert router.route([1, 2, 3, 4, 5], [3, 0]) == 0  # imbalance below the thresholds
    assert router.route([1, 2, 3, 4, 5], [10, 1]) == 1  # 9 more and 10x: least loaded


def test_each_replica_entry_is_bounded_and_forgets_its_least_recent_prompts():
    router = CacheAwareRouter(2, RouterOptions(max_tokens_per_replica=100))
    for i in range(30):
        router.record(0, [i] * 10)
    assert router.sizes[0] <= 100
    assert router.matched_lengths([29] * 10)[0] == 10 and router.matched_lengths([0] * 10)[0] == 0
    router.record(1, [29] * 10)
    router.forget(0)
    assert router.sizes == [0, 10] and router.matched_lengths([29] * 10) == [0, 10]


def test_a_dead_replica_is_never_chosen():
    router = CacheAwareRouter(3)
    router.record(1, [5, 6, 7])
    router.mark_dead(1)
    assert all(router.route([5, 6, 7, i], [0, 0, 0]) != 1 for i in range(10))
