"""Constraint specs: validation before compute, dtype / choices regexes, numeric ranges."""

from __future__ import annotations

import itertools
import json
import re
import string
from fractions import Fraction

import pytest
from test_constrained_helpers import (  # noqa: F401  (tiny_compiler is a fixture)
    SCHEMA_DIR,
    assert_stopped_by_automaton,
    generate,
    tiny_compiler,
)

from spruce.constrained import ConstraintError, ConstraintSpec
from spruce.constrained.automaton.limits import MAX_STRING_LENGTH
from spruce.constrained.core.ranges import integer_range_regex, number_range_regex
from spruce.constrained.spec import make_spec as _make_spec
from spruce.runtime import errors as runtime_errors


def make_spec(*args, **kwargs):
    """The spruce converter's spec (these tests are about its regexes)."""
    return _make_spec(*args, backend="spruce", **kwargs)


def test_no_constraint_is_none_and_two_are_an_error():
    assert make_spec() is None
    with pytest.raises(ConstraintError, match="at most one"):
        make_spec(regex="a", choices=["a"])


def test_spec_is_frozen_and_hashable():
    spec = make_spec(regex="^ab+$")
    assert (
        spec == ConstraintSpec("regex", "ab+", "ab+") and len({spec, make_spec(regex="ab+")}) == 1
    )
    with pytest.raises(AttributeError):
        spec.value = "x"


def test_the_runtime_error_is_both_a_constraint_and_a_request_error():
    error = runtime_errors.constraint_error(ConstraintError("bad"))
    assert isinstance(error, runtime_errors.InvalidRequestError) and isinstance(
        error, ConstraintError
    )
    assert str(error) == "bad" and runtime_errors.constraint_error(error) is error


@pytest.mark.parametrize(
    "regex, message",
    [
        ("[a-", "invalid regex"),
        ("a{2,1}", "invalid regex"),
        (r"(a)\1", "unsupported regex feature"),
        (r"\bword", "unsupported regex feature"),
        ("a(?=b)b", "lookaround"),
        ("[a-z]{0,50000}", "too large"),
    ],
)
def test_bad_regex_is_refused_before_compute(regex, message):
    with pytest.raises(ConstraintError, match=re.escape(message)):
        make_spec(regex=regex)


@pytest.mark.parametrize(
    "schema, message",
    [
        ('{"type": "object",', "not valid JSON"),
        (
            {"type": "string", "maxLength": MAX_STRING_LENGTH + 1},
            f"{MAX_STRING_LENGTH + 1} is above the cap",
        ),
        (
            {"type": "array", "items": {"type": "integer"}, "maxItems": 1000},
            "1000 is above the cap",
        ),
        ({"not": {"properties": {"a": {"pattern": "x"}}}}, "'not'"),
        ({"type": "integer", "multipleOf": 7919}, "'multipleOf'"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
        ({"if": {"properties": {"a": {"pattern": "x"}}}, "then": {"maxLength": 2}}, "'if'"),
        ({"type": "number", "minimum": 0.5}, "fractional"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "allows no value"),
        ({"type": "string", "pattern": "(a)\\1"}, "'pattern'"),
        ({"$ref": "https://example.com/s.json"}, "another document"),
        ({"$ref": "#/$defs/missing"}, "does not resolve"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allows no value"),
        ({"type": "array", "minItems": 5, "maxItems": 2}, "allows no value"),
        ({"type": "unknown"}, "unknown type"),
        ("[1, 2]", "must be an object"),
    ],
)
def test_unsupported_schema_is_refused_with_the_feature_named(schema, message):
    with pytest.raises(ConstraintError, match=re.escape(message)):
        make_spec(json_schema=schema, schema_mode="strict")


def test_allof_objects_are_merged_not_concatenated():
    spec = make_spec(json_schema=json.loads((SCHEMA_DIR / "allof.json").read_text()))
    regex = spec.regex
    assert re.fullmatch(regex, '{"id":3,"label":"x","score":0.5}')
    assert not re.fullmatch(regex, '{"id":3}{"label":"x","score":0.5}')


def test_whitespace_pattern_is_configurable():
    spec = make_spec(
        json_schema={"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    )
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    assert spec.regex == r'\{"a":(?:true|false)\}'
    assert re.fullmatch(
        make_spec(json_schema=schema, whitespace_pattern="[ ]?").regex, '{ "a" : true }'
    )


CHOICES = ["a.b", "(x)", "c++", "1|2", "", "é中", string.punctuation]


def test_choices_escape_every_metacharacter(tiny_compiler, tiny_tokenizer):
    spec = make_spec(choices=CHOICES)
    for choice in CHOICES:
        assert re.fullmatch(spec.value, choice)
    grammar = tiny_compiler.compile(spec)  # outlines-core (Rust regex) accepts the escapes
    seen = {generate(grammar, tiny_tokenizer, seed).text for seed in range(12)}
    assert seen <= set(CHOICES) and len(seen) > 2


@pytest.mark.parametrize("bad", [[], "ab", [1, 2]])
def test_bad_choices(bad):
    with pytest.raises(ConstraintError, match="choices"):
        make_spec(choices=bad)


@pytest.mark.parametrize(
    "dtype, parse",
    [
        (int, int),
        ("float", float),
        (bool, {"True": True, "False": False}.__getitem__),
        (str, json.loads),
    ],
)
def test_dtype_outputs_parse(tiny_compiler, tiny_tokenizer, dtype, parse):
    grammar = tiny_compiler.compile(make_spec(dtype=dtype))
    for seed in range(4):
        gen = generate(grammar, tiny_tokenizer, seed)
        assert_stopped_by_automaton(gen)
        parse(gen.text)


def test_unknown_dtype_lists_the_supported_ones():
    with pytest.raises(ConstraintError, match="int, float, bool, str"):
        make_spec(dtype=list)


BOUNDS = [None, -1000, -101, -100, -9, -1, 0, 1, 9, 10, 99, 100, 250, 1000, 1234]


def test_integer_range_regex_is_exact():
    for low, high in itertools.product(BOUNDS, BOUNDS):
        if low is not None and high is not None and low > high:
            continue
        regex = re.compile(integer_range_regex(low, high))
        for value in range(-1300, 1300, 7):
            inside = (low is None or value >= low) and (high is None or value <= high)
            assert bool(regex.fullmatch(str(value))) == inside, (low, high, value)
        assert not regex.fullmatch("-0") and not regex.fullmatch("007")


def test_number_range_regex_is_exact():
    texts = [f"{i}{f}" for i in range(-25, 26) for f in ("", ".0", ".5", ".05", ".999")]
    for low, high in itertools.product([None, -10, -1, 0, 1, 12], repeat=2):
        for low_ex, high_ex in itertools.product([False, True], repeat=2):
            if (
                low is not None
                and high is not None
                and (low > high or (low == high and (low_ex or high_ex)))
            ):
                continue
            regex = re.compile(number_range_regex(low, high, low_ex, high_ex))
            for text in texts:
                value = Fraction(text)
                inside = (low is None or (value > low if low_ex else value >= low)) and (
                    high is None or (value < high if high_ex else value <= high)
                )
                if text.startswith("-0") and value == 0:
                    inside = False  # "-0" is never produced
                assert bool(regex.fullmatch(text)) == inside, (low, high, low_ex, high_ex, text)
