"""gen(stop_regex=..., no_stop_trim=..., logit_bias=..., return_text_in_logprobs=...) as SGLang
programs write them, on both transports (ZeroMQ and HTTP) against the tiny model."""

from __future__ import annotations

import re

import spruce.lang as sgl
from spruce.runtime.text.tokenizer import Tokenizer

PROMPT = "The quick brown fox"


@sgl.function
def free(s):
    s += PROMPT
    s += sgl.gen("x", max_tokens=12, temperature=0)


@sgl.function
def stopped(s, pattern, keep):
    s += PROMPT
    s += sgl.gen(
        "x", max_tokens=12, temperature=0, stop_regex=pattern, no_stop_trim=keep,
        return_logprob=True, return_text_in_logprobs=True,
    )  # fmt: skip


def test_gen_stop_regex_and_token_text(endpoint):
    text = free.run(backend=endpoint)["x"]
    char = next(c for c in text[2:] if c.isalnum())
    at = text.find(char)
    state = stopped.run(pattern=re.escape(char), keep=False, backend=endpoint)
    assert state["x"] == text[:at]
    entries = state.get_meta_info("x")["output_token_logprobs"]
    assert entries and all(len(e) == 3 and isinstance(e[2], str) for e in entries)
    kept = stopped.run(pattern=re.escape(char), keep=True, backend=endpoint)
    assert kept["x"] == text[: at + 1]


@sgl.function
def biased(s):
    s += PROMPT
    s += sgl.gen("x", max_tokens=3, temperature=0, logit_bias={42: 100})


def test_gen_logit_bias(endpoint):
    state = biased.run(backend=endpoint)
    assert state.get_meta_info("x")["completion_tokens"] == 3
    assert state["x"] != free.run(backend=endpoint)["x"][: len(state["x"])]


@sgl.function
def budgeted(s, budget):
    s += PROMPT
    s += sgl.gen("x", max_tokens=24, temperature=0, ignore_eos=True, thinking_budget=budget,
                 thinking_close=" DONE.", return_logprob=True)  # fmt: skip


def test_gen_thinking_budget(endpoint, tiny_llama_dir):
    """The runtime writes the end marker after exactly `budget` sampled tokens of the block
    (the output starts inside it), then the answer goes on."""
    tokenizer = Tokenizer.from_folder(str(tiny_llama_dir))
    state = budgeted.run(budget=5, backend=endpoint)
    meta = state.get_meta_info("x")
    sampled = [e[1] for e in meta["output_token_logprobs"]]  # the marker's ids have none
    marker = tokenizer.encode(" DONE.", add_special_tokens=False)
    thought, answer = state["x"].split(" DONE.", 1)
    assert tokenizer.decode(sampled[:5]) == thought
    assert meta["completion_tokens"] == len(sampled) + len(marker) == 24
    assert answer
