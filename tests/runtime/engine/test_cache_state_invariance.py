"""A prompt's greedy output does not depend on whether part of it came from the prefix cache
(the bundled model on the CPU, a float16 K/V pool): its rows attend K/V as the pool holds
them either way. This is what keeps speculative decoding's outputs identical to plain
decoding's when drafts change which requests share a prefix at admission."""

from __future__ import annotations

import pytest
from support import bundled_gguf_path

pytestmark = pytest.mark.slow

PARAMS = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def logprobs(out: dict) -> list[float]:
    return [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]


def test_a_cached_prefix_gives_the_same_logits_as_a_cold_prompt():
    from spruce.runtime import Engine

    if bundled_gguf_path() is None:
        pytest.skip("the bundled model is not installed")
    engine = Engine(num_threads=2, kv_memory_gb=0.2)
    ask = "Explain what a database index is, and when it does not help a query."
    ids = engine.tokenizer.encode(
        engine.apply_chat_template([{"role": "user", "content": ask}]), add_special_tokens=False
    )
    # more than 12 new rows on each side: every linear layer takes the same kernel
    # (cpu_quant_ops.kernel picks by row count), so only the cache state differs
    head = len(ids) - 16
    assert head > 12
    cold = engine.generate(input_ids=ids, sampling_params=PARAMS, return_logprob=True)
    engine.flush_cache()
    engine.generate(input_ids=ids[:head], sampling_params={**PARAMS, "max_new_tokens": 1})
    warm = engine.generate(input_ids=ids, sampling_params=PARAMS, return_logprob=True)
    assert warm["meta_info"]["cached_tokens"] == head
    assert warm["output_ids"] == cold["output_ids"]
    assert logprobs(warm) == logprobs(cold)  # bit for bit
