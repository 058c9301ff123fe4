"""The linear-time regex seam (constrained/core/linear_regex.py): what it matches, what it refuses
(with the reason), its bounded cache, and the schema checks built on it."""

from __future__ import annotations

import pytest

from spruce.constrained.core import linear_regex
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.core.linear_regex import UnsupportedRegex
from spruce.constrained.report import validate_output
from spruce.constrained.schema.schema_validator import pattern_search, validator_class


def test_a_catastrophic_backtracking_pattern_answers_correctly():
    text = "a" * 100_000
    assert linear_regex.search("(a+)+b", text) is None
    assert linear_regex.search("(a+)+b", text + "b") == (0, 100_001)
    assert linear_regex.search("(a|aa)*c", text + "c") == (0, 100_001)


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        (r"(a)\1", "backreferences"),
        (r"(?P<x>a)(?P=x)", "backreferences"),
        (r"a(?=b)", "lookaround"),
        (r"(?<!a)b", "lookaround"),
        (r"(?>a)", "atomic"),
        (r"a++", "possessive"),
        (r"a{1001}", "1000"),
        (r"(unclosed", "missing )"),
    ],
)
def test_patterns_it_cannot_take_are_refused_with_the_reason(pattern, reason):
    with pytest.raises(UnsupportedRegex, match="linear time") as e:
        linear_regex.check(pattern)
    assert reason in e.value.reason
    assert isinstance(e.value, ConstraintError)


@pytest.mark.parametrize(
    ("pattern", "text", "span"),
    [
        (r"\w+", "  héllo", (2, 7)),  # \w is Unicode, as Python's re reads it
        (r"\s", "a\u3000", (1, 2)),
        (r"\W", "é!", (1, 2)),
        (r"\d", "٣", None),  # \d is [0-9] (ECMA 262, the byte automaton)
        (r"\u00e9", "é", (0, 1)),
        (r"a{,2}b", "aab", (0, 3)),  # Python's {,n}
        (r"a\Z", "ba", (1, 2)),
        (r"(?<name>x)", "x", (0, 1)),  # ECMA named group
        (r"(?P<name>x)", "x", (0, 1)),
        (r"[\s\S]", "é", (0, 1)),
        (r"\[\w\]", "[a]", (0, 3)),
    ],
)
def test_python_and_ecma_spellings_mean_what_they_say(pattern, text, span):
    assert linear_regex.search(pattern, text) == span


def test_a_start_position_keeps_caret_at_the_text_start():
    assert linear_regex.search("^a", "aa", 1) is None
    assert linear_regex.search("a", "aa", 1) == (1, 2)


def test_the_module_cache_is_bounded_by_compiled_bytes():
    """A short pattern can compile to megabytes (`\\w` is Unicode: ~1,300 instructions), so
    the cache counts programs, not pattern characters."""
    linear_regex._CACHE.clear()
    patterns = [rf"(?:\w|x{i}){{1,60}}" for i in range(40)]  # ~80k instructions each
    for pattern in patterns:
        assert linear_regex.search(pattern, "ab") == (0, 2)
    cache = linear_regex._CACHE
    assert 0 < len(cache) < len(patterns)  # the oldest were dropped
    assert cache.nbytes <= linear_regex.MAX_CACHED_BYTES
    assert (
        cache.nbytes >= len(cache) * 2_000_000
    )  # each counted by its program, not its 20 characters


def test_schema_patterns_with_leading_lookaheads_are_read_like_the_converter():
    pattern = "^(?=a)(?!ab)a.*$"
    assert pattern_search(pattern, "ac")
    assert not pattern_search(pattern, "ab")
    assert not pattern_search(pattern, "ba")
    with pytest.raises(UnsupportedRegex):
        pattern_search(r"(a)\1", "aa")


def test_validation_of_backtracking_patterns_finishes():
    key = "a" * 40
    schema = {"patternProperties": {"(a+)+b": {}}, "additionalProperties": False}
    assert validate_output(schema, f'{{"{key}": 1}}')["valid"] is False
    assert validate_output(schema, f'{{"{key}b": 1}}')["valid"] is True
    assert validate_output({"pattern": "(a+)+b"}, f'"{"a" * 100_000}"')["valid"] is False


def test_unevaluated_properties_beside_pattern_properties_is_not_checked_with_re():
    schema = {"patternProperties": {"(a+)+b": {}}, "unevaluatedProperties": False}
    report = validate_output(schema, f'{{"{"a" * 40}": 1}}')
    assert report["valid"] is None and "unevaluatedProperties" in report["error"]


def test_the_finish_report_of_json_python_will_not_read_says_it_could_not_validate():
    report = validate_output({"type": "integer", "minimum": 1}, "1" * 4400)
    assert (
        report["valid"] is None and "4300 digits" in report["error"]
    )  # valid JSON Python will not read
    assert validate_output({"type": "array"}, "[" * 100_000)["valid"] is None


@pytest.mark.parametrize("keyword", ["$schema", "$id"])
@pytest.mark.parametrize("value", [[1], 1, {"a": 1}, None])
def test_a_root_schema_or_id_that_is_not_a_string_is_a_constraint_error(keyword, value):
    with pytest.raises(ConstraintError, match=f"\\{keyword} must be a string"):
        validator_class({keyword: value, "type": "integer"})


def test_a_draft4_id_that_is_not_a_string_is_a_constraint_error():
    with pytest.raises(ConstraintError, match="id must be a string"):
        validator_class({"$schema": "http://json-schema.org/draft-04/schema#", "id": [1]})
