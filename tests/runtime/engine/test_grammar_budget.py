"""A grammar that outgrows its memory budget while a request walks it aborts that request
with a clear message; a request beside it in the same batch finishes normally, and the
engine's accounting stays exact."""

from __future__ import annotations

import re

import pytest

from spruce.runtime import Engine
from spruce.runtime.errors import ConstraintError

GROWING = {"temperature": 0.8, "seed": 1, "max_new_tokens": 200, "regex": "(a|b)*a(a|b){24}c"}
SMALL = {"temperature": 0, "max_new_tokens": 8, "regex": "[0-9]{4}"}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = Engine(str(tiny_llama_dir), kv_memory_gb=0.02, num_threads=1, chunked_prefill_size=64)
    # the NFA and first mask fit (~75 kB); the states walked before the 26th token, the
    # first that may end the match, do not (~170 kB in C, ~330 kB in the Python automaton)
    engine.core.compiler.grammar_bytes = 120_000
    return engine


def final_chunks(chunks) -> dict[int, dict]:
    return {c["index"]: c for c in chunks if c["finished"]}


def test_a_grammar_past_its_budget_aborts_its_request_and_the_other_finishes(engine):
    chunks = list(engine.generate(["x", "y"], [GROWING, SMALL], stream=True))
    done = final_chunks(chunks)
    grown, small = done[0]["meta_info"]["finish_reason"], done[1]["meta_info"]["finish_reason"]
    assert grown["type"] == "abort" and "memory budget" in grown["message"], grown
    assert small["type"] != "abort", small
    text = "".join(c["text"] for c in chunks if c["index"] == 1)
    assert re.fullmatch("[0-9]{4}", text), text
    engine.core.check_integrity()


def test_the_engine_serves_the_next_constrained_request(engine):
    out = engine.generate("z", SMALL)
    assert (
        re.fullmatch("[0-9]{4}", out["text"])
        and out["meta_info"]["finish_reason"]["type"] != "abort"
    )


def test_without_a_stream_the_error_is_a_constraint_error(engine):
    """A request error (400 for a server client), not a fault of the runtime (500)."""
    faults = engine.core.scheduler.stats.request_faults
    with pytest.raises(ConstraintError, match="memory budget"):
        engine.generate("x", GROWING)
    assert engine.core.scheduler.stats.request_faults == faults
