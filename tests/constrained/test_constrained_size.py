"""The size cap on a schema's regex: strict mode names the schema paths that make it large;
lenient mode relaxes them (bounds, then patterns / formats, then the whole subtree) and
reports what it relaxed; the output is then validated against the full schema."""

from __future__ import annotations

import json
import re

import pytest

from spruce.constrained import ConstraintError
from spruce.constrained.automaton.limits import MAX_EXPANDED_SIZE, regex_lengths, regex_size
from spruce.constrained.schema.json_schema import canonical_instance, convert_schema
from spruce.constrained.schema.schema_context import SchemaOptions

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 250},
        "note": {"type": "string", "maxLength": 250},
        "mail": {"type": "string", "format": "email"},
    },
    "required": ["name"],
}
ARRAY_OF_ITEMS = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "properties": {"containers": {"type": "array", "items": ITEM, "maxItems": 60}},
        },
        "tag": {"type": "string", "maxLength": 8},
    },
    "required": ["spec"],
}
BIG_ENUM = {
    "type": "object",
    "properties": {"code": {"enum": [f"code-{i:05d}" for i in range(4000)]}},
    "required": ["code"],
}


@pytest.mark.parametrize(
    "regex, size",
    [("a{3}", 3), ("(ab){2,5}", 10), ("a*", 1), ("a|bc", 3), ("[a-z]{4}x", 5), (r"\d{2,}", 2),
     ("(?:a(?:b{2}){3})?", 7), (r"\{\}", 2), ('"(?:[^"\\\\]|\\\\.){0,40}"', 122)],
)  # fmt: skip
def test_regex_size_multiplies_out_bounded_repeats(regex, size):
    assert regex_size(regex) == size


@pytest.mark.parametrize(
    "regex, lengths",
    [("abc", (3, 3)), ("a|bcd", (1, 3)), ("(ab){2,5}", (4, 10)), ("a*", (0, None)), ("x+y", (2, None)),
     ("(a|bc)?d", (1, 3)), ("(?:ab|c)(?:d|ef){2}", (3, 6))],
)  # fmt: skip
def test_regex_lengths_reads_the_shortest_and_longest_match(regex, lengths):
    assert regex_lengths(regex) == lengths


def test_a_format_within_the_length_bounds_needs_no_intersection():
    assert convert_schema({"type": "string", "format": "date", "maxLength": 40}).unenforced == ()
    converted = convert_schema({"type": "string", "format": "email", "maxLength": 100})
    assert converted.unenforced_at == {"maxLength": ["#"]}  # the product automaton is too large
    with pytest.raises(ConstraintError, match="'maxLength' at #"):
        convert_schema(
            {"type": "string", "format": "email", "maxLength": 100}, SchemaOptions(mode="strict")
        )


def test_strict_mode_names_the_paths_that_make_the_regex_large():
    with pytest.raises(ConstraintError) as info:
        convert_schema(ARRAY_OF_ITEMS, SchemaOptions(mode="strict"))
    message = str(info.value)
    assert f"cap {MAX_EXPANDED_SIZE}" in message
    assert "#/properties/spec/properties/containers (" in message  # the array that repeats its item
    assert "#/properties/tag" not in message  # small parts are not named


def test_lenient_mode_relaxes_the_heaviest_bound_and_reports_it():
    converted = convert_schema(ARRAY_OF_ITEMS)
    assert converted.unenforced == ("maxItems",)
    assert converted.unenforced_at == {"maxItems": ["#/properties/spec/properties/containers"]}
    assert regex_size(converted.regex) <= MAX_EXPANDED_SIZE
    regex = re.compile(converted.regex)
    many = {"spec": {"containers": [{"name": "x"}] * 65}}  # past maxItems: accepted, reported
    assert regex.fullmatch(canonical_instance(many, converted.orders))
    assert not regex.fullmatch(
        canonical_instance({"spec": {"containers": [{"name": "x" * 251}]}}, converted.orders)
    )
    assert not regex.fullmatch(
        canonical_instance(
            {"spec": {"containers": [{"name": "x", "mail": "no"}]}}, converted.orders
        )
    )


def test_lenient_mode_loosens_a_subtree_it_cannot_shrink_otherwise():
    converted = convert_schema(BIG_ENUM)
    assert converted.unenforced == ("enum",)
    assert converted.unenforced_at == {"enum": ["#/properties/code"]}
    regex = re.compile(converted.regex)
    assert regex.fullmatch('{"code":"code-00007"}') and regex.fullmatch('{"code":"anything"}')
    assert not regex.fullmatch('{"code":7}')  # its type is kept
    with pytest.raises(ConstraintError, match="#/properties/code"):
        convert_schema(BIG_ENUM, SchemaOptions(mode="strict"))


def test_only_as_many_bounds_are_relaxed_as_the_cap_needs():
    names = [f"p{i}" for i in range(48)]  # 48 strings of up to 250 characters: about 36k positions
    schema = {
        "$defs": {"text": {"type": "string", "maxLength": 250}},
        "type": "object",
        "properties": {name: {"$ref": "#/$defs/text"} for name in names},
        "required": names,
    }
    converted = convert_schema(schema)
    assert converted.unenforced == ("maxLength",)
    relaxed = converted.unenforced_at["maxLength"]
    assert 0 < len(relaxed) < len(names) and regex_size(converted.regex) <= MAX_EXPANDED_SIZE
    loose, kept = (
        relaxed[0].rsplit("/", 1)[1],
        next(n for n in names if f"#/properties/{n}" not in relaxed),
    )

    def text(long):
        return json.dumps(
            {n: "x" * (300 if n == long else 1) for n in names}, separators=(",", ":")
        )

    assert re.fullmatch(converted.regex, text(loose)) and not re.fullmatch(
        converted.regex, text(kept)
    )
