"""gen(dtype=str) writes a JSON string: every string its regex accepts is valid JSON (no raw
control characters), while REGEX_STR keeps SGLang's spelling."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

import spruce.lang as sl
from spruce.constrained.automaton.byte_dfa import DEAD, ByteDFA
from spruce.constrained.automaton.byte_nfa import build_nfa


def dtype_str_regex() -> str:
    return dict(sl.gen("x", dtype=str).sampling)["regex"]


def accepts(regex: str, text: str) -> bool:
    """The constrained automaton's answer (what the grammar lets a model write)."""
    dfa = ByteDFA(build_nfa(regex))
    state = dfa.walk(dfa.initial, text.encode())
    return state != DEAD and dfa.is_accepting(state)


def test_raw_control_characters_are_refused_and_escapes_accepted():
    regex = dtype_str_regex()
    for raw in ('"a\nb"', '"a\tb"', '"a\x00b"', '"a\x1fb"', '"a"b"', '"a\\"'):
        assert not accepts(regex, raw), raw
    for good in ('"a\\nb"', '"a\\tb"', '"\\"q\\""', '"\\\\"', '"é ü 42"', '""'):
        assert accepts(regex, good), good
        json.loads(good)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12))
def test_every_string_the_regex_accepts_is_json(body):
    text = f'"{body}"'
    if re.fullmatch(dtype_str_regex(), text):
        assert json.loads(text) is not None


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12))
def test_every_json_encoded_string_without_unicode_escapes_is_accepted(value):
    text = json.dumps(value, ensure_ascii=False)
    if "\\u" not in text and not any("\x7f" <= c <= "\x9f" for c in value):
        assert re.fullmatch(dtype_str_regex(), text)


def test_regex_str_keeps_sglang_spelling():
    assert sl.REGEX_STR == r'"[\w\s]*"'
