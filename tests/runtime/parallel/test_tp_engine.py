"""Engine(tp_size=2): two ranks over gloo (this process is rank 0, the other a child
process) give the logits of one process (float32, tight tolerance) for an extend, an
extend after a cached prefix and a decode batch; greedy outputs, regex-constrained outputs
and the radix cache work unchanged. (One tensor-parallel engine per process at a time: the
engines that start and stop on their own are in test_tp_startup.py.)"""

from __future__ import annotations

import re

import pytest
import torch

from spruce.runtime import Engine
from spruce.runtime.executor.model_runner import ForwardItem

OPTIONS = {"kv_memory_gb": 0.02, "num_threads": 1, "kv_cache_dtype": "float32"}
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    reference = Engine(str(tiny_llama_dir), **OPTIONS)
    tp = Engine(str(tiny_llama_dir), tp_size=2, **OPTIONS)
    yield reference, tp
    tp.shutdown()
    reference.shutdown()


def run_steps(runner) -> list[torch.Tensor]:
    """Extend, extend after the request's own prefix, a second row sharing the first's
    prefix (a table write, as the radix cache makes), then a decode batch of both rows."""
    rows = [runner.req_to_token.alloc_row() for _ in range(2)]
    slots = [runner.pool.alloc(n) for n in (12, 5, 6, 1, 1)]
    a, b, c = ids(1, 12), ids(2, 5), ids(3, 6)
    out = [runner.forward([ForwardItem(rows[0], 0, a, slots[0], True)]).logits]
    out.append(runner.forward([ForwardItem(rows[0], 12, b, slots[1], True)]).logits)
    runner.req_to_token.write(rows[1], 0, slots[0])
    out.append(runner.forward([ForwardItem(rows[1], 12, c, slots[2], True)]).logits)
    decode = [ForwardItem(rows[0], 17, [7], slots[3]), ForwardItem(rows[1], 18, [9], slots[4])]
    out.append(runner.forward(decode).logits)
    for row in rows:
        runner.req_to_token.free_row(row)
    runner.pool.free(torch.cat(slots))
    return out


def test_logits_equal_one_process(engines):
    reference, tp = engines
    assert len(tp.core.followers) == 1 and tp.core.tp.world == 2
    assert tp.core.runner.pool.shape.kv_heads == 1  # this rank's KV heads only (2 in the model)
    expected, got = run_steps(reference.core.runner), run_steps(tp.core.runner)
    assert (
        [g.shape for g in got]
        == [e.shape for e in expected]
        == [(12, 384), (5, 384), (6, 384), (2, 384)]
    )
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_greedy_outputs_of_a_batch_are_identical(engines):
    reference, tp = engines
    prompts = [ids(10 + i, 5 + 3 * i) for i in range(8)]
    expected = [
        o["output_ids"] for o in reference.generate(input_ids=prompts, sampling_params=GREEDY)
    ]
    got = [o["output_ids"] for o in tp.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert got == expected and all(len(o) == 8 for o in got)


def test_constrained_decoding_and_the_radix_cache_on_top(engines):
    reference, tp = engines
    regex = "[0-9]{3}-[a-c]{2}"
    prefix = ids(30, 40)
    prompts = [prefix + ids(31 + i, 4) for i in range(3)]
    params = {**GREEDY, "max_new_tokens": 16, "regex": regex}
    for engine in (reference, tp):
        engine.flush_cache()
    expected = [reference.generate(input_ids=p, sampling_params=params) for p in prompts]
    got = [tp.generate(input_ids=p, sampling_params=params) for p in prompts]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert all(re.fullmatch(regex, o["text"]) for o in got), [o["text"] for o in got]
    assert [o["meta_info"]["cached_tokens"] for o in got[1:]] == [40, 40]
    streamed = [
        c["output_ids"]
        for c in tp.generate(input_ids=prompts[0], sampling_params=GREEDY, stream=True)
    ]
    assert [t for ids in streamed for t in ids] == reference.generate(
        input_ids=prompts[0], sampling_params=GREEDY
    )["output_ids"]
    assert tp.stats()["cached_prompt_tokens_total"] >= 80
