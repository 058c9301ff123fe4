"""`spruce bench offline --breakdown` on a tiny model: every part is timed, the parts add up
to the timed step, and the timers leave the engine as they found it."""

from __future__ import annotations

from spruce.runtime import Engine
from spruce.runtime.bench.breakdown import BREAKDOWN_ROWS, step_breakdown


def test_the_parts_add_up_to_the_step_and_the_timers_come_off(tiny_llama_dir):
    engine = Engine(str(tiny_llama_dir), kv_memory_gb=0.02, num_threads=1)
    core = engine.core
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    before = engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]
    result = step_breakdown(engine, [5, 6, 7], params)
    assert result["steps"] >= 4 and set(result["parts_ms"]) == {label for label, _, _ in BREAKDOWN_ROWS}
    parts = result["parts_ms"]
    assert parts["matmuls (linear layers + output head)"] > 0 and parts["attention (KV write + attention)"] > 0
    assert abs(sum(parts.values()) - result["timed_step_ms"]) < 1e-6 * max(1.0, result["timed_step_ms"]) + 1e-3
    assert "step" not in core.__dict__ and "forward" not in core.runner.__dict__  # wrappers removed
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in core.runner.model.modules())
    engine.flush_cache()
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"] == before
