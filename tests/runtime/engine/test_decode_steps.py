"""Several greedy decode steps in one call (`decode_steps`): the tokens are those of one step
at a time, bit for bit, from the C decode plan and from the forward-pass fallback alike; the
scheduler runs them only for plain argmax requests decoding alone, within max_new_tokens and
a time bound, and stops, stop strings, failed rows and the KV accounting work as in plain
decoding."""

from __future__ import annotations

import math
import re

import pytest
import torch
from support import add_request
from test_engine import GREEDY, make_engine, prompts

from spruce.runtime.executor.kernels import cpu_quant_ops
from spruce.runtime.executor.model_runner import ForwardItem, ModelRunner
from spruce.runtime.executor.sampler import NO_TOKEN
from spruce.runtime.models import decode_plan
from spruce.runtime.models.loading.loader import load_model
from spruce.runtime.scheduler.faults import RequestFault

needs_c = pytest.mark.skipif(not cpu_quant_ops.available(), reason="no C compiler")
MANY = max(cpu_quant_ops.INTEGER_MAX_ROWS.values()) + 2  # the plan's GEMM path


def prefilled(loaded, prompts_: list[list[int]], kv_dtype=torch.float32):
    """A runner with `prompts_` prefilled; the items of their first decode step (each the
    prompt's last token again at its end, with `steps` slots), built by `items(steps)`."""
    runner = ModelRunner(loaded, 512 + 16 * len(prompts_), len(prompts_) + 1, 96, kv_dtype=kv_dtype)
    rows = [runner.req_to_token.alloc_row() for _ in prompts_]
    runner.forward(
        [ForwardItem(r, 0, p, runner.pool.alloc(len(p))) for r, p in zip(rows, prompts_)]
    )

    def items(steps: int) -> list[ForwardItem]:
        return [
            ForwardItem(r, len(p), [p[-1]], runner.pool.alloc(steps))
            for r, p in zip(rows, prompts_)
        ]

    return runner, items


def both_paths(loaded, prompts_, steps, monkeypatch, kv_dtype=torch.float32):
    """(the C plan's ids and logits, the forward passes'), from the same prefilled state;
    asserts the C call ran."""
    calls = []
    real = decode_plan.DecodePlan.decode_steps
    monkeypatch.setattr(
        decode_plan.DecodePlan, "decode_steps", lambda *a: calls.append(1) or real(*a)
    )
    runner, items = prefilled(loaded, prompts_, kv_dtype)
    in_c = runner.decode_steps(items(steps), steps)
    assert calls == [1]
    runner, items = prefilled(loaded, prompts_, kv_dtype)
    by_forward = runner._decode_steps_by_forward(items(steps), steps)
    assert calls == [1]  # the forward passes' plan steps are single ones
    return in_c, by_forward


@needs_c
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])  # Qwen2: q/k/v bias
@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize(
    "requests,kv_dtype", [(1, torch.float16), (3, torch.float32), (MANY, torch.int8)]
)
def test_steps_in_c_equal_forward_passes(request, monkeypatch, fixture, qtype, requests, kv_dtype):
    loaded = load_model(str(request.getfixturevalue(fixture)), quantization=qtype)
    batch = [[3 + i, 40 + i, 77, 12 + 5 * i, 9][: 2 + i % 4] for i in range(requests)]
    (c_ids, c_best), (f_ids, f_best) = both_paths(loaded, batch, 6, monkeypatch, kv_dtype)
    assert c_ids == f_ids and c_best == f_best  # floats compared exactly
    assert len(c_ids) == requests and all(len(row) == 6 for row in c_ids)
    assert all(math.isfinite(v) for row in c_best for v in row)


@needs_c
def test_float_embedding_table(tiny_llama_dir, monkeypatch):
    """An embedding table kept in float32 (only the linear layers quantized) is looked up
    in C as the model looks it up."""
    loaded = load_model(str(tiny_llama_dir), quantization="q8_0")
    model = loaded.model
    if model.lm_head is None:  # tied: the table is the (quantized) head
        pytest.skip("the tiny model ties its embeddings")
    from spruce.runtime.models.layers import Embedding, QuantizedEmbedding

    table = model.embed_tokens
    if type(table) is QuantizedEmbedding:
        plain = Embedding(table.out_features, table.in_features)
        plain.weight.data = table(torch.arange(table.out_features))
        model.embed_tokens = plain
    assert model._embedding_table()[0] == -1
    (c_ids, c_best), (f_ids, f_best) = both_paths(loaded, [[5, 9, 200], [7]], 4, monkeypatch)
    assert c_ids == f_ids and c_best == f_best


# -- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized(tiny_llama_dir):
    return make_engine(tiny_llama_dir, quantization="q4_1")


@pytest.fixture(scope="module")
def one_step(tiny_llama_dir):
    return make_engine(tiny_llama_dir, quantization="q4_1", decode_steps=1)


def counted_steps(engine) -> list[int]:
    """Records the `steps` of every scheduled step of `engine` (until the test ends)."""
    seen = []
    scheduler = engine.core.scheduler
    real = scheduler.schedule

    def schedule():
        out = real()
        seen.append(out.steps)
        return out

    scheduler.schedule = schedule
    return seen


def test_outputs_equal_one_step_at_a_time(quantized, one_step, monkeypatch):
    """Greedy requests with their own lengths, stop strings and EOS, beside a sampled one
    (which keeps the batch to one step at a time while it runs): the outputs, finish
    reasons and the pool's accounting are those of one step at a time."""
    batch = prompts(5, seed=11)
    params = [
        {**GREEDY, "max_new_tokens": 3},
        {**GREEDY, "max_new_tokens": 29},
        {"temperature": 0, "max_new_tokens": 40},  # EOS may end it
        {**GREEDY, "max_new_tokens": 25, "stop": ["e", "a"]},
        {"temperature": 0.8, "max_new_tokens": 6, "seed": 3},
    ]
    steps = counted_steps(quantized)
    try:
        many = quantized.generate(input_ids=batch, sampling_params=params)
    finally:
        del quantized.core.scheduler.schedule
    one = one_step.generate(input_ids=batch, sampling_params=params)
    assert [r["output_ids"] for r in many] == [r["output_ids"] for r in one]
    assert [r["meta_info"]["finish_reason"] for r in many] == [
        r["meta_info"]["finish_reason"] for r in one
    ]
    assert max(steps) > 1 and max(steps) <= 8
    quantized.core.check_integrity()


def test_a_request_arriving_waits_no_more_than_one_call(quantized):
    core = quantized.core
    first, second = prompts(2, seed=12)
    a = add_request(core, first, {**GREEDY, "max_new_tokens": 60})
    while len(a.output_ids) < 10:
        core.step()
    b = add_request(core, second, {**GREEDY, "max_new_tokens": 5})
    core.step()  # the waiting request is admitted at once
    assert b.output_ids and not a.finished
    while not (a.finished and b.finished):
        core.step()
    core.check_integrity()


def test_a_step_without_a_token_ends_the_tokens_there(quantized, monkeypatch):
    """A logit that is not finite at step j keeps the tokens before it (the request goes on
    from there); at the first step it is the request's row error, as in the sampler."""
    runner = quantized.core.runner
    real = runner.decode_steps
    at, calls = {"step": 2}, []

    def broken(items, steps):
        calls.append(steps)
        ids, best = real(items, steps)
        best[0][min(at["step"], steps - 1)] = float("nan")
        return ids, best

    monkeypatch.setattr(runner, "decode_steps", broken)
    prompt = prompts(1, seed=13)[0]
    expected = quantized.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 1})
    out = quantized.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 30})
    monkeypatch.undo()
    assert calls and min(calls) > 1
    plain = quantized.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 30})
    assert out["output_ids"] == plain["output_ids"]
    assert out["output_ids"][:1] == expected["output_ids"]
    monkeypatch.setattr(runner, "decode_steps", broken)
    at["step"] = 0
    with pytest.raises(RequestFault, match=re.escape(NO_TOKEN)):
        quantized.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 30})
    quantized.core.check_integrity()
