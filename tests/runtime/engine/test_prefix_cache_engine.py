"""The radix cache inside the Engine: same outputs with and without it, real hits,
sharing during chunked prefill, flush, eviction under pressure."""

from __future__ import annotations

import pytest
import torch
from support import add_request
from test_engine import GREEDY, ids_of, make_engine

from spruce.runtime import InvalidRequestError


def random_ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def cached(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


@pytest.fixture(scope="module")
def uncached(tiny_llama_dir):
    return make_engine(tiny_llama_dir, disable_radix_cache=True)


def shared_prefix_prompts() -> list[list[int]]:
    base = random_ids(1, 120)
    other = random_ids(2, 60)
    return [
        base + random_ids(3, 10),
        base[:80] + random_ids(4, 15),  # diverges inside the first request's node
        base + random_ids(5, 3),
        base[:80] + random_ids(4, 15) + [7],  # extends the second one
        other,
        other[:30] + base[:50],
    ]


def test_cache_hits_give_the_same_outputs(cached, uncached):
    prompts = shared_prefix_prompts()
    expected = [
        uncached.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts
    ]
    one_by_one = [cached.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
    assert ids_of(one_by_one) == expected
    assert [r["meta_info"]["cached_tokens"] for r in one_by_one[1:4]] == [80, 120, 95]
    assert ids_of(cached.generate(input_ids=prompts, sampling_params=GREEDY)) == expected
    cached.core.cache_manager.check_integrity([])


def test_second_request_reports_cached_prefix_then_flush_resets(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prefix = random_ids(10, 200)
    first = engine.generate(input_ids=prefix + [5, 6], sampling_params=GREEDY)
    second = engine.generate(input_ids=prefix + [9, 9, 9], sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= 200
    stats = engine.stats()
    assert stats["prompt_tokens_total"] == 405 and stats["cached_prompt_tokens_total"] >= 200
    engine.flush_cache()
    assert engine.stats()["cache_tokens"] == 0
    third = engine.generate(input_ids=prefix + [9, 9, 9], sampling_params=GREEDY)
    assert third["meta_info"]["cached_tokens"] == 0
    assert third["output_ids"] == second["output_ids"]


def test_flush_refused_while_requests_run(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    core = engine.core
    add_request(core, random_ids(11, 20), GREEDY)
    core.step()
    with pytest.raises(InvalidRequestError, match="while requests are running"):
        engine.flush_cache()


def test_chunked_prefill_shares_its_prefix_while_running(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, chunked_prefill_size=32)
    core = engine.core
    prefix = random_ids(12, 200)
    first = add_request(core, prefix + [4], GREEDY)
    core.step()
    core.step()  # 64 tokens of the first prompt computed and inserted so far
    second = add_request(core, prefix + [8, 8], GREEDY)
    while not (first.finished and second.finished):
        core.step()
    assert second.cached_tokens >= 64
    alone = make_engine(tiny_llama_dir, disable_radix_cache=True)
    assert (
        second.output_ids
        == alone.generate(input_ids=prefix + [8, 8], sampling_params=GREEDY)["output_ids"]
    )


def test_eviction_and_retraction_under_a_small_pool(tiny_llama_dir, uncached):
    prompts = [random_ids(20, 50) + random_ids(100 + i, 20) for i in range(12)]
    params = {**GREEDY, "max_new_tokens": 30}
    expected = ids_of(uncached.generate(input_ids=prompts, sampling_params=params))
    small = make_engine(
        tiny_llama_dir, kv_memory_gb=300 * 512 / 2**30, context_length=150, decode_reserve_ratio=0.0
    )
    for _ in range(2):  # the second round starts with a full cache that must be evicted
        assert ids_of(small.generate(input_ids=prompts, sampling_params=params)) == expected
    stats = small.stats()
    assert stats["evicted_tokens_total"] > 0 and stats["retractions_total"] > 0
    small.core.cache_manager.check_integrity([])
    small.flush_cache()
    assert small.stats()["kv_slots_free"] == small.stats()["kv_slots_total"]


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_policies_give_the_same_outputs(tiny_llama_dir, uncached, policy):
    prompts = shared_prefix_prompts()
    expected = ids_of(uncached.generate(input_ids=prompts, sampling_params=GREEDY))
    engine = make_engine(tiny_llama_dir, schedule_policy=policy, max_running_requests=2)
    assert ids_of(engine.generate(input_ids=prompts, sampling_params=GREEDY)) == expected


def test_unknown_policy_lists_the_known_ones(tiny_llama_dir):
    with pytest.raises(Exception, match="unknown schedule policy 'lifo'.*fcfs, lpm, dfs-weight"):
        make_engine(tiny_llama_dir, schedule_policy="lifo")
