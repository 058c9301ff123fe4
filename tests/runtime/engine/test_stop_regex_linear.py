"""stop_regex is matched in linear time on the scheduler loop: a pattern that makes a
backtracking engine run for minutes finishes the request normally, and one the linear engine
cannot take is refused before anything runs."""

from __future__ import annotations

import pytest

from spruce.runtime import Engine
from spruce.runtime.errors import InvalidRequestError


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(str(tiny_llama_dir), kv_memory_gb=0.02, num_threads=1, chunked_prefill_size=64)


def test_a_backtracking_stop_regex_finishes_with_the_constrained_output(engine):
    params = {"max_new_tokens": 64, "temperature": 0, "regex": "a{64}", "stop_regex": "(a+)+b"}
    result = engine.generate("x", sampling_params=params)
    assert result["text"] == "a" * 64
    assert result["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    plain = engine.generate(
        "x", sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    )
    assert len(plain["output_ids"]) == 4


@pytest.mark.parametrize(
    ("pattern", "reason"), [(r"(a)\1", "backreferences"), ("a(?=b)", "lookaround")]
)
def test_a_stop_regex_the_linear_engine_cannot_take_is_refused(engine, pattern, reason):
    with pytest.raises(InvalidRequestError, match=f"stop_regex .*{reason}"):
        engine.generate("x", sampling_params={"max_new_tokens": 4, "stop_regex": pattern})
