"""`python -m spruce.lang.bench` runs end to end (tiny model, a handful of programs)."""

from __future__ import annotations

import importlib.util

import pytest

from spruce.lang import bench


@pytest.mark.skipif(
    importlib.util.find_spec("spruce.runtime.server.launch") is None, reason="no spruce serve"
)
def test_bench_prints_the_ratio(tiny_llama_dir, capsys):
    bench.main([
        "--model", str(tiny_llama_dir), "--num-programs", "4", "--num-shots", "2", "--max-tokens", "2",
        "--num-threads", "1", "--kv-memory-gb", "0.25",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert "4 programs" in out and "speedup" in out and "identical answers" in out


def test_few_shot_prefix_is_deterministic():
    assert bench.few_shot_prefix(3) == bench.few_shot_prefix(3)
    assert bench.few_shot_prefix(3).count("Question:") == 3
