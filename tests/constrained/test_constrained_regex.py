"""Random regexes from a safe subset: every random-logit output full-matches its regex, and
every valid string's canonical tokens are accepted (the end-marker fix of outlines-core's
one-byte-late match reporting)."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_constrained_helpers import assert_stopped_by_automaton, generate, tiny_compiler  # noqa: F401

from spruce.constrained import make_spec
from spruce.constrained.core.patterns import escape_literal

LITERALS = ["a", "b", "x", "ab", "é", "中", "0", "-", ".", " ", "😀", '"']
CLASSES = ["[a-c]", "[xyz]", "[0-9]", "[^a-z]", r"\d", "[é中]", "[.-]"]

atoms = st.one_of(st.sampled_from(LITERALS).map(escape_literal), st.sampled_from(CLASSES))


# Counted repeats apply to single atoms only: nested or ambiguous counted repeats of wide
# classes (e.g. `[.-]?(?:[^a-z]{1,4}){2,5}x`) make outlines-core's DFA build explode.
repeated_atoms = st.tuples(atoms, st.integers(0, 2), st.integers(0, 3)).map(
    lambda t: f"(?:{t[0]}){{{t[1]},{t[1] + t[2]}}}"
)


def _compound(children):
    return st.one_of(
        st.lists(children, min_size=2, max_size=4).map("".join),
        st.lists(children, min_size=2, max_size=3).map(lambda xs: "(?:" + "|".join(xs) + ")"),
        children.map(lambda c: f"(?:{c})?"),
    )


regexes = st.recursive(st.one_of(atoms, repeated_atoms), _compound, max_leaves=8)
SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@settings(max_examples=60, **SETTINGS)
@given(regex=regexes, seed=st.integers(0, 2**16), jump_forward=st.booleans())
def test_random_logit_outputs_fullmatch(tiny_compiler, tiny_tokenizer, regex, seed, jump_forward):
    grammar = tiny_compiler.compile(make_spec(regex=regex))
    gen = generate(grammar, tiny_tokenizer, seed, jump_forward=jump_forward, max_steps=500)
    assert_stopped_by_automaton(gen)
    assert re.fullmatch(regex, gen.text, re.ASCII), (regex, gen.text)  # \d is [0-9]


def _encodable(text: str) -> bool:
    return all(not 0xD800 <= ord(c) <= 0xDFFF and ord(c) < 0x100000 for c in text)


@settings(max_examples=60, **SETTINGS)
@given(data=st.data(), regex=regexes)
def test_canonical_tokens_of_valid_strings_are_accepted(tiny_compiler, tiny_tokenizer, data, regex):
    text = data.draw(st.from_regex(re.compile(regex, re.ASCII), fullmatch=True).filter(_encodable))
    cursor = tiny_compiler.compile(make_spec(regex=regex)).cursor()
    for token_id in tiny_tokenizer.encode(text, add_special_tokens=False):
        assert cursor.accept_token(token_id), (regex, text, token_id)
    assert cursor.can_end()
