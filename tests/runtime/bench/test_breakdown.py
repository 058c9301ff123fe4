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
    assert result["steps"] >= 4 and set(result["parts_ms"]) == {
        label for label, _, _ in BREAKDOWN_ROWS
    }
    parts = result["parts_ms"]
    assert (
        parts["matmuls (linear layers + output head)"] > 0
        and parts["attention (KV write + attention)"] > 0
    )
    assert (
        abs(sum(parts.values()) - result["timed_step_ms"])
        < 1e-6 * max(1.0, result["timed_step_ms"]) + 1e-3
    )
    assert "step" not in core.__dict__ and "forward" not in core.runner.__dict__  # wrappers removed
    assert core.scheduler.decode_steps == 8  # one step a call while timed, then back
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in core.runner.model.modules())
    engine.flush_cache()
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"] == before


def test_step_over_matmuls_pairs_each_sampled_step_with_the_bare_matmuls(tiny_llama_dir):
    """The paired probe of `spruce bench offline`: every 2nd all-decode step at the full batch
    is timed with the bare matmuls right after it; the requests all finish and the step log
    is put back."""
    from spruce.runtime.bench.breakdown import step_over_matmuls

    engine = Engine(str(tiny_llama_dir), kv_memory_gb=0.02, num_threads=1)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    result = step_over_matmuls(engine, prompts, {"max_new_tokens": 12, "temperature": 0}, every=2)
    assert result["paired_batch"] == 3 and 3 <= result["pairs"] <= 6
    assert result["paired_step_ms"] > 0 and result["bare_matmul_ms"] > 0
    assert result["decode_step_over_matmul"] == result["paired_step_ms"] / result["bare_matmul_ms"]
    assert engine.core.step_log is None and not engine.core.has_work()
