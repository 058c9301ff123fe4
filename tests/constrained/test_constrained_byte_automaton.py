"""The byte-level NFA and its lazy DFA against Python's `re`, and the token trie's walk
against walking every token."""

from __future__ import annotations

import random
import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_constrained_helpers import tiny_compiler  # noqa: F401  (a fixture)

from spruce.constrained import ConstraintError, make_spec
from spruce.constrained.automaton.byte_dfa import DEAD, ByteDFA
from spruce.constrained.automaton.byte_nfa import _utf8_sequences, build_nfa
from spruce.constrained.automaton.token_trie import TokenTrie
from spruce.constrained.core.patterns import JSON_NUMBER, JSON_STRING, json_value_regex

REGEXES = [
    JSON_STRING, JSON_NUMBER, r"(a|b)*a(a|b){3}", r"\w+\s[^a-c]{2,3}", r".x?", r"(?:ab|a)(?:bc|c)*",
    r"[^\x00-\x7f]+é", r"\{(\"k\":[0-9]{1,3})?\}", r"[a-z]{0,4}[😀-🙏]?", r"(x|)+y", r"\W\S",
]  # fmt: skip
ALPHABET = 'abcxy éñ😀🙏"\\{}:019\x00\x7f\t\n-.eE+ٓ٣_'


def _matches(dfa: ByteDFA, text: str) -> bool:
    state = dfa.walk(dfa.initial, text.encode())
    return state != DEAD and dfa.is_accepting(state)


@pytest.mark.parametrize("regex", REGEXES)
def test_the_dfa_matches_like_re_on_random_strings(regex):
    dfa, rng = ByteDFA(build_nfa(regex)), random.Random(regex)
    for _ in range(400):
        text = "".join(rng.choices(ALPHABET, k=rng.randint(0, 6)))
        assert _matches(dfa, text) == (re.fullmatch(regex, text) is not None), text


@pytest.mark.parametrize("regex", REGEXES)
def test_every_prefix_of_a_match_is_alive_and_only_matches_accept(regex):
    dfa = ByteDFA(build_nfa(regex))

    @settings(max_examples=60, deadline=None)
    @given(st.from_regex(regex.replace(r"\w", "[a-z_]").replace(r"\s", " "), fullmatch=True))
    def check(text):
        data, state = text.encode(), dfa.initial
        for byte in data:
            state = dfa.step(state, byte)
            assert state != DEAD, text
        assert dfa.is_accepting(state)

    check()


def test_digits_are_ascii_as_in_json_schema_patterns():
    dfa = ByteDFA(build_nfa(r"\d\D"))
    assert _matches(dfa, "1x") and _matches(dfa, "1٣") and not _matches(dfa, "٣x")


def test_utf8_sequences_cover_each_code_point_exactly_once():
    sequences = _utf8_sequences(((0, 0x10FFFF),))
    rng = random.Random(0)
    for code in [0, 0x7F, 0x80, 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF, 0x10000, 0x10FFFF] + [
        rng.randint(0, 0x10FFFF) for _ in range(2000)
    ]:
        if 0xD800 <= code <= 0xDFFF:
            continue
        data = chr(code).encode()
        hits = [
            s
            for s in sequences
            if len(s) == len(data) and all(a <= b <= c for (a, c), b in zip(s, data))
        ]
        assert len(hits) == 1, hex(code)


@pytest.mark.parametrize(
    "regex, message",
    [("a(?=b)", "unsupported"), (r"(a)\1", "unsupported"), ("^a$", "unsupported"), ("(?i)a", "flags"),
     ("[^\\x00-\\U0010ffff]", "matches no string"), ("(a", "invalid regex"), ("(?>ab)", "atomic"),
     ("a*+", "possessive")],
)  # fmt: skip
def test_unsupported_regexes_are_refused_with_a_reason(regex, message):
    with pytest.raises(ConstraintError, match=message):
        build_nfa(regex)


def test_determinization_is_lazy():
    """2^24 DFA states in full: built in milliseconds, a walk makes only what it visits."""
    start = time.perf_counter()
    dfa = ByteDFA(build_nfa("(a|b)*a(a|b){24}"))
    text = "ab" * 40 + "a" * 25
    assert _matches(dfa, text) and not _matches(dfa, text + "b" * 24 + "b")
    assert dfa.num_states < 200 and time.perf_counter() - start < 5


def test_any_json_at_depth_three_is_cheap_to_build():
    start = time.perf_counter()
    nfa = build_nfa(json_value_regex(3))
    assert nfa.num_states < 50_000 and time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "regex", [JSON_STRING, r"[a-c]+x?", r'\{"name":"[a-z]{1,8}"\}', "(x|cafe)+"]
)
def test_the_trie_walk_equals_walking_every_token(tiny_compiler, tiny_tokenizer, regex):
    grammar = tiny_compiler.compile(make_spec(regex=regex))
    vocab, rng = tiny_compiler.vocab, random.Random(0)
    state = grammar.initial_state
    for _ in range(6):
        walked = {
            i
            for i, data in enumerate(vocab.token_bytes)
            if data and grammar.dfa.walk(state, data) != DEAD
        }
        assert set(np.flatnonzero(vocab.trie.allowed(grammar.dfa, state)).tolist()) == walked
        if not walked:
            break
        state = grammar.next_state(state, rng.choice(sorted(walked)))


@pytest.mark.parametrize("regex", [r"[a-c]*", r"(?:ab|c){2,12}d?", JSON_STRING])
def test_the_trie_walk_equals_walking_every_token_with_long_tokens(regex):
    """A made-up vocabulary: 3,000 short tokens and 40 of 10-40 bytes, whose deep, thin levels
    the walk does one node at a time."""
    rng = random.Random(1)
    lengths = [rng.randint(1, 6) for _ in range(3000)] + [rng.randint(10, 40) for _ in range(40)]
    tokens = [b""] + [
        bytes(rng.choice(b'abcd"' if n < 10 else b"abc") for _ in range(n)) for n in lengths
    ]
    trie, dfa = TokenTrie(tokens), ByteDFA(build_nfa(regex))
    for prefix in [b"", b"ab", b'"a']:
        state = dfa.walk(dfa.initial, prefix)
        if state == DEAD:
            continue
        walked = {i for i, data in enumerate(tokens) if data and dfa.walk(state, data) != DEAD}
        assert set(np.flatnonzero(trie.allowed(dfa, state)).tolist()) == walked
