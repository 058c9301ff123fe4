"""The thinking budget in the Engine on the tiny random model: the reasoning block holds
exactly `thinking_budget` tokens, then the runtime writes the end marker and the answer
follows (under a constraint: an answer in its language)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from test_engine import make_engine

from spruce.constrained.schema.json_schema import schema_to_regex
from spruce.runtime import InvalidRequestError
from spruce.runtime.scheduler.thinking import plain_ids
from spruce.runtime.text.reasoning import REASONING_FORMATS

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "maximum": 999, "minimum": 0}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir, kv_memory_gb=0.05, grammar_backend="spruce")


def close_ids(engine, text="</think>") -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_free_text_stops_thinking_at_exactly_the_budget(engine):
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True, "thinking_budget": 7}
    out = engine.generate(input_ids=[5, 9, 11], sampling_params=params)
    ids, marker = out["output_ids"], close_ids(engine)
    assert ids[7 : 7 + len(marker)] == marker, "the end marker comes right after 7 tokens"
    assert len(ids) == 30  # the answer goes on after the block


def test_a_message_and_an_open_marker(engine):
    params = {
        "temperature": 0, "max_new_tokens": 40, "ignore_eos": True, "thinking_budget": 4,
        "thinking_open": "<think>", "thinking_close": " Enough.</think>",
    }  # fmt: skip
    # without the open marker in the output the block never starts: no forced text
    plain = engine.generate(input_ids=[5, 9, 11], sampling_params=params)
    assert " Enough." not in plain["text"]
    opened = engine.tokenizer.encode("<think>", add_special_tokens=False)
    params["regex"] = r"<think>[a-z ]{0,60} Enough\.</think>[a-z]{1,5}"
    out = engine.generate(input_ids=[5, 9, 11], sampling_params=params)
    ids, marker = out["output_ids"], close_ids(engine, " Enough.</think>")
    start = len(opened)
    assert ids[:start] == opened
    assert ids[start + 4 : start + 4 + len(marker)] == marker
    assert re.fullmatch(params["regex"], out["text"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constrained_answer_after_the_budget_validates(engine, seed):
    fmt = REASONING_FORMATS["qwen3"]
    regex = fmt.constraint_regex(schema_to_regex(SCHEMA), inside=True)
    params = {
        "temperature": 1.0, "seed": seed, "max_new_tokens": 80, "regex": regex,
        "thinking_budget": 12,
    }  # fmt: skip
    out = engine.generate(input_ids=[5, 9, 11 + seed], sampling_params=params)
    reasoning, answer = fmt.split(out["text"], inside=True)
    ids, marker = out["output_ids"], close_ids(engine)
    decode = lambda end: engine.tokenizer.decode(ids[:end], skip_special_tokens=False)  # noqa: E731
    closed = next(end for end in range(len(ids) + 1) if "</think>" in decode(end))
    # closed by the model within its 12 tokens (in any spelling), or by the runtime after them
    # (a few tokens later when the 12th left a UTF-8 character open: the grammar needs it whole)
    forced_at = closed - len(marker)
    assert closed <= 12 or (ids[forced_at:closed] == marker and 12 <= forced_at <= 15)
    assert reasoning is not None
    jsonschema.validate(json.loads(answer), SCHEMA)


@pytest.mark.parametrize(
    "params", [{"thinking_budget": 0}, {"thinking_budget": "x"}, {"thinking_close": ""},
               {"thinking_open": ""}],
)  # fmt: skip
def test_bad_budgets_are_refused_naming_the_field(engine, params):
    with pytest.raises(InvalidRequestError) as e:
        engine.generate(input_ids=[5, 9], sampling_params={"max_new_tokens": 4, **params})
    assert e.value.field == next(iter(params))


HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
HARMONY_CLOSE = "<|end|><|start|>assistant<|channel|>final<|message|>"


@pytest.fixture(scope="module")
def special_marker_engine(tmp_path_factory):
    """A tiny model whose tokenizer has gpt-oss's markers as special tokens."""
    from support import write_tiny_model
    from tokenizers import Tokenizer

    folder = write_tiny_model(tmp_path_factory.mktemp("harmony-tiny"), "llama", vocab_size=391)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(HARMONY)
    tokenizer.save(str(folder / "tokenizer.json"))
    return make_engine(folder, kv_memory_gb=0.05, grammar_backend="spruce")


def test_a_special_token_marker_under_a_grammar_is_written_in_ordinary_tokens(
    special_marker_engine,
):
    engine = special_marker_engine
    regex = r"[a-z ]{0,80}" + re.escape(HARMONY_CLOSE) + r"[0-9]{1,3}"
    params = {"temperature": 0, "max_new_tokens": 60, "regex": regex, "thinking_budget": 6,
              "thinking_close": HARMONY_CLOSE, "skip_special_tokens": False}  # fmt: skip
    out = engine.generate(input_ids=[5, 9, 11], sampling_params=params)
    assert re.fullmatch(regex, out["text"]), out["text"]
    plain = list(plain_ids(engine.tokenizer, HARMONY_CLOSE))
    assert out["output_ids"][6 : 6 + len(plain)] == plain  # the grammar refuses special tokens
    # free text: the canonical special tokens
    free = engine.generate(input_ids=[5, 9, 11], sampling_params={**params, "regex": None})
    marker = engine.tokenizer.encode(HARMONY_CLOSE, add_special_tokens=False)
    assert free["output_ids"][6 : 6 + len(marker)] == marker


@pytest.mark.parametrize("seed", [0, 1])
def test_harmony_markers_as_special_tokens_under_llguidance(special_marker_engine, seed):
    """gpt-oss's markers are special tokens: the Lark grammar after its analysis channel
    names them as tokens (a quoted string would never match them), the budget closes the
    analysis with the special tokens themselves, and the final answer validates."""
    engine = special_marker_engine
    fmt = REASONING_FORMATS["gpt-oss"]
    specials = engine.tokenizer.special_tokens
    lark = fmt.constraint_lark("%json " + json.dumps(SCHEMA), False, specials)
    params = {"temperature": 1.0, "seed": seed, "max_new_tokens": 80, "lark": lark,
              "grammar_backend": "llguidance", "skip_special_tokens": False,
              **fmt.budget_fields(6, False, None)}  # fmt: skip
    out = engine.generate(input_ids=[5, 9, 11], sampling_params=params)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    channel = engine.tokenizer.encode("<|channel|>", add_special_tokens=False)
    assert len(channel) == 1 and channel[0] in out["output_ids"]  # the special token itself
    answer = fmt.split(out["text"], inside=False)[1]  # after an analysis, if it wrote one
    jsonschema.validate(json.loads(answer), SCHEMA)
