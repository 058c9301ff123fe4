"""Engine(dp_size=2): two EngineCores (own KV pool and radix cache each) behind the
router. On a few-shot workload (4 prefixes x 16 questions, shuffled) cache-aware routing
keeps one core's hit rate and beats round-robin; outputs equal one core's; stats and
flush cover both cores; `spruce bench prefix --dp 2` reports the three side by side."""

from __future__ import annotations

import json
import random

import pytest
import torch

from spruce.runtime import Engine, InvalidRequestError
from spruce.runtime.cli import main
from spruce.runtime.scheduler.router import CacheAwareRouter, RoundRobinRouter

OPTIONS = {"kv_memory_gb": 0.02, "num_threads": 1, "kv_cache_dtype": "float32"}
PARAMS = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def few_shot() -> list[list[int]]:
    prefixes = [ids(p, 48) for p in range(4)]
    prompts = [
        prefix + ids(100 + 16 * p + q, 6) for p, prefix in enumerate(prefixes) for q in range(16)
    ]
    random.Random(0).shuffle(prompts)
    return prompts


def hit_rate(engine: Engine, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    engine.flush_cache()
    before = engine.stats()["cached_prompt_tokens_total"]
    outs = engine.generate(input_ids=prompts, sampling_params=PARAMS)
    cached = engine.stats()["cached_prompt_tokens_total"] - before
    return cached / sum(len(p) for p in prompts), [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def single(tiny_llama_dir):
    with Engine(str(tiny_llama_dir), **OPTIONS) as engine:
        yield engine


def test_cache_aware_routing_keeps_the_hit_rate(single):
    prompts = few_shot()
    one, expected = hit_rate(single, prompts)
    loaded = single.core.loaded
    with Engine(loaded=loaded, dp_size=2, **OPTIONS) as dp:  # cache-aware by default
        cache_aware, outputs = hit_rate(dp, prompts)
        served = [s["requests_finished_total"] for s in dp.stats()["replicas"]]
    with Engine(loaded=loaded, dp_size=2, router=RoundRobinRouter(2), **OPTIONS) as dp:
        round_robin, _ = hit_rate(dp, prompts)
    print(
        f"\nhit rate: dp 1 {one:.3f}, dp 2 cache-aware {cache_aware:.3f}, dp 2 round-robin {round_robin:.3f}"
    )
    assert outputs == expected
    assert all(n >= 16 for n in served)  # both cores worked
    assert cache_aware >= one - 0.05
    assert round_robin < cache_aware - 0.02


def test_stats_and_flush_cover_every_core(single):
    with Engine(loaded=single.core.loaded, dp_size=2, router=CacheAwareRouter(2), **OPTIONS) as dp:
        dp.generate(input_ids=[ids(1, 30), ids(2, 30), ids(1, 30) + [5]], sampling_params=PARAMS)
        stats = dp.stats()
        assert stats["dp_size"] == 2 and len(stats["replicas"]) == 2
        assert stats["requests_finished_total"] == 3
        assert stats["cache_tokens"] == sum(s["cache_tokens"] for s in stats["replicas"]) > 0
        chunks = list(dp.generate(input_ids=ids(3, 10), sampling_params=PARAMS, stream=True))
        assert chunks[-1]["finished"]
        dp.flush_cache()
        assert dp.stats()["cache_tokens"] == 0


def test_dp_routes_cache_aware_by_default_and_not_with_tp(single):
    with Engine(loaded=single.core.loaded, dp_size=2, **OPTIONS) as dp:
        assert isinstance(dp.router, CacheAwareRouter)
    with Engine(loaded=single.core.loaded, dp_size=2, router="round-robin", **OPTIONS) as dp:
        assert isinstance(dp.router, RoundRobinRouter)
    with pytest.raises(InvalidRequestError, match="unknown router policy 'nearest'; known: "):
        Engine(loaded=single.core.loaded, dp_size=2, router="nearest", **OPTIONS)
    with pytest.raises(InvalidRequestError, match="must be a policy name or have route"):
        Engine(loaded=single.core.loaded, dp_size=2, router=3, **OPTIONS)
    with pytest.raises(InvalidRequestError, match="not both"):
        Engine(dp_size=2, router=CacheAwareRouter(2), tp_size=2, **OPTIONS)


def test_bench_prefix_dp(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "dp.json"
    argv = [
        "bench", "prefix", "--dp", "2", "--workloads", "few-shot", "--num-prefixes", "4", "--questions", "8",
        "--prefix-len", "48", "--question-len", "6", "--output-len", "2", "--output-json", str(out),
        "--model", str(tiny_llama_dir), "--num-threads", "1", "--kv-memory-gb", "0.02",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["results"]["dp"]["few-shot"]
    assert list(rows) == ["dp 1", "dp 2 cache-aware", "dp 2 round-robin"]
    assert rows["dp 2 cache-aware"]["hit_rate"] >= rows["dp 1"]["hit_rate"] - 0.05
    assert rows["dp 2 round-robin"]["hit_rate"] < rows["dp 2 cache-aware"]["hit_rate"]
    assert "dp 2 cache-aware" in capsys.readouterr().out
