"""Compressed FSM: forced bytes of the byte DFA and jump-forward."""

from __future__ import annotations

import json

import pytest
from test_constrained_helpers import (  # noqa: F401  (tiny_compiler is a fixture)
    SCHEMA_DIR,
    assert_valid_json,
    build_merge_tokenizer,
    generate,
    tiny_compiler,
)

from spruce.constrained import GrammarCompiler, make_spec
from spruce.constrained.automaton.byte_dfa import ByteDFA
from spruce.constrained.automaton.byte_nfa import build_nfa

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "regex, prefix, forced",
    [
        ("[a]bc[de]", "", "abc"),  # a one-member class is a single character
        ("abc?", "", "ab"),  # stops at an accepting state
        ("[^x]yz", "", ""),
        ("[^x]yz", "q", "yz"),
        ("[aA]b", "", ""),
        ("éa", "", "éa"),
        ("[éè]a", "", "\xc3"),  # the shared lead byte (the cursor forces whole characters only)
        ("(ab|ac)d", "a", ""),
        ("(ab|ac)d", "ab", "d"),
        ("é+x", "é", ""),
    ],
)
def test_forced_strings(regex, prefix, forced):
    dfa = ByteDFA(build_nfa(regex))
    assert dfa.forced_bytes(dfa.walk(dfa.initial, prefix.encode())) == forced.encode(
        "latin-1" if "\xc3" in forced else "utf-8"
    )


def test_fixed_keys_are_forced(tiny_compiler, tiny_tokenizer):
    cursor = tiny_compiler.compile(make_spec(json_schema=PERSON)).cursor()
    assert cursor.jump_forward_text() == '{"name":"'
    cursor.accept_token(_ids(tiny_tokenizer, "{")[0])
    assert cursor.jump_forward_text().startswith('"name":')


def test_jump_at_the_start_and_after_a_value(tiny_compiler, tiny_tokenizer):
    cursor = tiny_compiler.compile(make_spec(json_schema=PERSON)).cursor()
    jump = cursor.jump_forward([], tiny_tokenizer)
    assert (jump.rollback, jump.new_ids, jump.text) == (
        0,
        _ids(tiny_tokenizer, '{"name":"'),
        '{"name":"',
    )
    ids = list(jump.new_ids)
    for token_id in _ids(tiny_tokenizer, "al") + _ids(tiny_tokenizer, '"'):
        assert cursor.accept_token(token_id)
        ids.append(token_id)
    # the forced ',"age":' merges with the closing quote: '"' + ',' -> '",'
    jump = cursor.jump_forward(ids, tiny_tokenizer)
    assert jump.text == ',"age":'
    assert jump.rollback == 1 and tiny_tokenizer.decode(jump.new_ids[:1]) == '",'
    ids = ids[: len(ids) - jump.rollback] + jump.new_ids
    assert tiny_tokenizer.decode(ids) == '{"name":"al","age":'
    assert cursor.num_accepted == len(ids) and cursor.jump_forward(ids, tiny_tokenizer) is None


def test_jump_completes_a_character_the_last_token_left_open(tiny_compiler, tiny_tokenizer):
    cursor = tiny_compiler.compile(make_spec(regex="(?:a|bc)éxyz")).cursor()
    lead_byte = tiny_compiler.vocab.token_bytes.index(b"\xc3")
    ids = _ids(tiny_tokenizer, "a") + [lead_byte]
    assert all(cursor.accept_token(t) for t in ids)
    assert cursor.jump_forward_text() == "éxyz"
    jump = cursor.jump_forward(ids, tiny_tokenizer)
    ids = ids[: len(ids) - jump.rollback] + jump.new_ids
    assert tiny_tokenizer.decode(ids) == "aéxyz" and cursor.can_end() and cursor.is_terminated()


def test_jump_across_repetitions_rolls_back_two_tokens():
    tokenizer = build_merge_tokenizer([("x", "c"), ("a", "f"), ("af", "e")])
    compiler = GrammarCompiler(tokenizer)
    cursor = compiler.compile(make_spec(regex="x(cafe)*")).cursor()
    ids = _ids(tokenizer, "x") + _ids(tokenizer, "c")
    assert all(cursor.accept_token(t) for t in ids)
    jump = cursor.jump_forward(ids, tokenizer)  # "xc" + "afe": a token over a match position
    assert jump.rollback == 2 and jump.new_ids == _ids(tokenizer, "xcafe")
    compiler.close()


class _SpecialEncoder:
    """Encodes anything as one special token: ids whose bytes are not the text."""

    def __init__(self, token_id):
        self.token_id = token_id

    def encode(self, text, add_special_tokens=False):
        return [self.token_id]


def test_refused_retokenization_returns_none_and_leaves_the_cursor(tiny_compiler, tiny_tokenizer):
    cursor = tiny_compiler.compile(make_spec(regex="xyz[ab]")).cursor()
    eos = next(iter(tiny_tokenizer.eos_token_ids))
    assert cursor.jump_forward([], _SpecialEncoder(eos)) is None
    assert cursor.num_accepted == 0
    jump = cursor.jump_forward([], tiny_tokenizer)  # the canonical tokens are fine
    assert tiny_tokenizer.decode(jump.new_ids) == "xyz" and not cursor.can_end()


def test_special_token_text_is_never_jumped(tiny_compiler, tiny_tokenizer):
    cursor = tiny_compiler.compile(make_spec(regex="say<\\|im_start\\|>")).cursor()
    assert cursor.jump_forward([], tiny_tokenizer) is None and cursor.num_accepted == 0


def test_output_ids_must_end_with_the_cursor_tokens(tiny_compiler, tiny_tokenizer):
    cursor = tiny_compiler.compile(make_spec(json_schema=PERSON)).cursor()
    cursor.accept_token(_ids(tiny_tokenizer, "{")[0])
    with pytest.raises(ValueError, match="output_ids"):
        cursor.jump_forward([5], tiny_tokenizer)


def test_min_forced_chars(tiny_compiler, tiny_tokenizer):
    cursor = tiny_compiler.compile(make_spec(regex="[ab]cd")).cursor()
    ids = _ids(tiny_tokenizer, "a")
    cursor.accept_token(ids[0])
    assert cursor.jump_forward(ids, tiny_tokenizer, min_forced_chars=3) is None
    assert cursor.jump_forward(ids, tiny_tokenizer, min_forced_chars=2) is not None


def test_jump_forward_cuts_decode_steps(tiny_compiler, tiny_tokenizer):
    schema = json.loads((SCHEMA_DIR / "character.json").read_text())
    grammar = tiny_compiler.compile(make_spec(json_schema=schema))
    plain = [generate(grammar, tiny_tokenizer, seed) for seed in range(4)]
    jumped = [generate(grammar, tiny_tokenizer, seed, jump_forward=True) for seed in range(4)]
    for gen in jumped:
        assert_valid_json(gen.text, schema)
    plain_steps, jumped_steps = sum(g.steps for g in plain), sum(g.steps for g in jumped)
    assert jumped_steps < 0.8 * plain_steps, (plain_steps, jumped_steps)
