"""JSON Schema features, one by one: instances the regex must accept and instances it must
refuse (compact JSON, keys in the grammar's order); every accepted one also validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from spruce.constrained import ConstraintError
from spruce.constrained.report import validate_output
from spruce.constrained.schema.json_schema import convert_schema
from spruce.constrained.schema.schema_context import SchemaOptions
from spruce.constrained.spec import make_spec as _make_spec


def make_spec(*args, **kwargs):
    """The spruce converter's spec (these tests are about its regexes)."""
    return _make_spec(*args, backend="spruce", **kwargs)


DRAFT4 = "http://json-schema.org/draft-04/schema#"

FEATURES = {
    "unknown_keywords_are_annotations": (
        {
            "type": "object",
            "id": "x",
            "x-kubernetes-preserve": True,
            "javaType": "Foo",
            "markdownDescription": "m",
            "properties": {"a": {"type": "integer", "example": 3, "self": {}}},
            "required": ["a"],
            "additionalProperties": False,
        },
        ['{"a":1}'],
        ['{"a":"x"}', "{}"],
    ),
    "ref_with_siblings": (
        {"$defs": {"n": {"type": "integer", "minimum": 0}}, "$ref": "#/$defs/n", "maximum": 5},
        ["0", "5"],
        ["-1", "6", '"a"'],
    ),
    "draft4_exclusive_minimum_boolean": (
        {
            "$schema": DRAFT4,
            "type": "integer",
            "minimum": 3,
            "exclusiveMinimum": True,
            "maximum": 5,
        },
        ["4", "5"],
        ["3", "6"],
    ),
    "draft4_items_array_and_additional_items": (
        {
            "$schema": DRAFT4,
            "type": "array",
            "items": [{"type": "integer"}, {"type": "string"}],
            "additionalItems": False,
        },
        ["[]", "[1]", '[1,"a"]'],
        ['[1,"a",2]', '["a"]'],
    ),
    "prefix_items_then_items": (
        {
            "type": "array",
            "prefixItems": [{"const": 1}],
            "items": {"type": "boolean"},
            "minItems": 2,
            "maxItems": 3,
        },
        ["[1,true]", "[1,true,false]"],
        ["[1]", "[1,true,true,true]", "[2,true]"],
    ),
    "any_of_with_sibling_properties": (
        {
            "type": "object",
            "properties": {"kind": {"type": "string"}},
            "required": ["kind"],
            "anyOf": [
                {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
            ],
        },
        ['{"kind":"x","a":1}', '{"kind":"x","b":true}'],
        ['{"kind":"x"}', '{"a":1}'],
    ),
    "one_of_overlap_refused": (
        {"oneOf": [{"type": "integer", "maximum": 10}, {"type": "integer", "minimum": 5}]},
        ["4", "11"],
        ["5", "10", "7"],
    ),
    "one_of_discriminated": (
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"t": {"const": "a"}, "x": {"type": "integer"}},
                    "required": ["t", "x"],
                },
                {
                    "type": "object",
                    "properties": {"t": {"const": "b"}, "y": {"type": "string"}},
                    "required": ["t", "y"],
                },
            ]
        },
        ['{"t":"a","x":1}', '{"t":"b","y":"s"}'],
        ['{"t":"a","y":"s"}', '{"t":"c","x":1}'],
    ),
    "all_of_merges_bounds_and_required": (
        {
            "allOf": [
                {
                    "type": "object",
                    "properties": {"a": {"type": "integer", "minimum": 0}},
                    "required": ["a"],
                },
                {"properties": {"a": {"maximum": 3}, "b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        ['{"a":0,"b":""}', '{"a":3,"b":"x"}'],
        ['{"a":4,"b":""}', '{"a":1}'],
    ),
    "all_of_two_patterns_intersected": (
        {"allOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"pattern": "^.{2,3}$"}]},
        ['"ab"', '"abc"'],
        ['"a"', '"abcd"', '"A1"'],
    ),
    "not_required": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "not": {"required": ["a", "b"]},
        },
        ["{}", '{"a":1}', '{"b":2}'],
        ['{"a":1,"b":2}'],
    ),
    "not_type": (
        {"not": {"type": ["string", "object", "array", "null", "boolean"]}},
        ["1", "-2.5"],
        ['"a"', "null", "[]"],
    ),
    "not_enum_on_strings": (
        {"type": "string", "maxLength": 3, "not": {"enum": ["ab", "c"]}},
        ['"a"', '"abc"', '""'],
        ['"ab"', '"c"'],
    ),
    "not_any_of": (
        {"type": "integer", "not": {"anyOf": [{"const": 1}, {"const": 2}]}},
        ["0", "3"],
        ["1", "2"],
    ),
    "if_then_else": (
        {
            "type": "object",
            "properties": {"t": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
            "required": ["t", "n"],
            "if": {"properties": {"t": {"const": "a"}}},
            "then": {"properties": {"n": {"maximum": 0}}},
            "else": {"properties": {"n": {"minimum": 10}}},
        },
        ['{"t":"a","n":0}', '{"t":"b","n":10}'],
        ['{"t":"a","n":5}', '{"t":"b","n":5}'],
    ),
    "pattern_properties_closed": (
        {
            "type": "object",
            "patternProperties": {"^x-": {"type": "integer"}},
            "additionalProperties": False,
        },
        ["{}", '{"x-a":1}', '{"x-a":1,"x-b":2}'],
        ['{"y":1}', '{"x-a":"s"}'],
    ),
    "additional_properties_schema": (
        {
            "type": "object",
            "properties": {"id": {"type": "integer"}},
            "required": ["id"],
            "additionalProperties": {"type": "boolean"},
        },
        ['{"id":1}', '{"id":1,"ok":true}'],
        ['{"id":1,"ok":1}', '{"id":1,"id2":"x"}'],
    ),
    "property_names": (
        {
            "type": "object",
            "propertyNames": {"pattern": "^[a-z]{1,3}$"},
            "additionalProperties": {"type": "integer"},
        },
        ["{}", '{"ab":1}'],
        ['{"abcd":1}', '{"A":1}'],
    ),
    "min_max_properties": (
        {
            "type": "object",
            "properties": {
                "a": {"type": "integer"},
                "b": {"type": "integer"},
                "c": {"type": "integer"},
            },
            "minProperties": 1,
            "maxProperties": 2,
        },
        ['{"a":1}', '{"a":1,"c":3}'],
        ["{}", '{"a":1,"b":2,"c":3}'],
    ),
    "dependent_required": (
        {
            "type": "object",
            "properties": {"card": {"type": "string"}, "cvv": {"type": "string"}},
            "dependentRequired": {"card": ["cvv"]},
        },
        ["{}", '{"cvv":"1"}', '{"card":"x","cvv":"1"}'],
        ['{"card":"x"}'],
    ),
    "multiple_of_integers_with_negatives": (
        {"type": "integer", "multipleOf": 3, "minimum": -10},
        ["-9", "0", "3", "300"],
        ["-12", "-1", "4", "10"],
    ),
    "multiple_of_decimal": (
        {"type": "number", "multipleOf": 0.01},
        ["1", "1.5", "-2.25"],
        ["1.001", "0.125"],
    ),
    "pattern_with_lengths": (
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4},
        ['"ab"', '"abcd"'],
        ['"a"', '"abcde"', '"aB"'],
    ),
    "unanchored_pattern_is_a_search": (
        {"type": "string", "pattern": "\\.json", "maxLength": 12},
        ['"a.json"', '".jsonx"'],
        ['"json"'],
    ),
    "formats": (
        {
            "type": "array",
            "prefixItems": [
                {"format": "ipv4", "type": "string"},
                {"format": "date", "type": "string"},
            ],
            "items": False,
            "minItems": 2,
        },
        ['["10.0.0.1","2024-02-29"]'],
        ['["10.0.0.256","2024-02-29"]', '["1.1.1.1","2023-02-29"]'],
    ),
    "enum_with_objects_and_arrays": (
        {"enum": [{"a": 1}, [1, 2], "x", None]},
        ['{"a":1}', "[1,2]", '"x"', "null"],
        ['{"a":2}', "[2,1]", '"y"'],
    ),
    "recursive_tree_at_the_bound": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/node",
        },
        ['{"v":1}', '{"v":1,"kids":[{"v":2,"kids":[{"v":3,"kids":[{"v":4}]}]}]}'],
        [
            '{"v":1,"kids":[{"v":2,"kids":[{"v":3,"kids":[{"v":4,"kids":[{"v":5}]}]}]}]}',
            '{"kids":[]}',
        ],
    ),
    "recursive_linked_list": (
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
                    "required": ["next"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/n",
        },
        ['{"next":null}', '{"next":{"next":null}}'],
        ["{}", '{"next":1}'],
    ),
    "any_json_depth": (
        {"type": "object", "additionalProperties": {}},
        ['{"a":{"b":1}}', '{"a":[2]}'],
        ['{"a":{"b":[1]}}'],
    ),
    "negative_lookahead": (
        {"type": "string", "pattern": "^(?!@@)[a-z@]+$"},
        ['"ab"', '"a@@"', '"@b"'],
        ['"@@b"', '""'],
    ),
    "negative_lookahead_of_a_word": (
        {
            "type": "object",
            "patternProperties": {"^(?!variables$).+$": {"type": "integer"}},
            "properties": {"variables": {"type": "string"}},
            "additionalProperties": False,
        },
        ['{"variables":"x"}', '{"v":1}', '{"variabless":2}'],
        ['{"v":"x"}', '{"variables":1}'],
    ),
    "positive_lookaheads": (
        {"type": "string", "pattern": "^(?=.*[A-Z])(?=.*[0-9]).{4,6}$"},
        ['"Abc1"', '"1aaZ"'],
        ['"abc1"', '"ABCD"', '"A1"', '"Abcdef1"'],
    ),
    "date_time_to_nanoseconds": (
        {"type": "string", "format": "date-time"},
        ['"2021-06-15T09:16:47.765072012+02:00"', '"2021-06-15T09:16:47Z"'],
        ['"2021-06-15T09:16:47.7650720123Z"', '"2021-06-15 09:16:47Z"'],
    ),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_accepts_and_refuses_exactly(name):
    schema, accepted, refused = FEATURES[name]
    converted = convert_schema(schema, SchemaOptions(mode="strict"))
    regex = re.compile(converted.regex)
    for text in accepted:
        assert regex.fullmatch(text), f"{name}: refused {text}"
        jsonschema.validators.validator_for(schema)(schema).validate(json.loads(text))
    for text in refused:
        assert not regex.fullmatch(text), f"{name}: accepted {text}"


def test_any_order_option_accepts_every_order():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a"],
    }
    regex = re.compile(convert_schema(schema, SchemaOptions(any_order_max=3)).regex)
    for text in ('{"a":1}', '{"a":1,"b":2}', '{"b":2,"a":1}'):
        assert regex.fullmatch(text)
    assert not regex.fullmatch('{"b":2}') and not regex.fullmatch('{"a":1,"a":1}')


def test_required_first_order():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["b"],
    }
    regex = re.compile(convert_schema(schema, SchemaOptions(property_order="required_first")).regex)
    assert regex.fullmatch('{"b":1,"a":2}') and not regex.fullmatch('{"a":2,"b":1}')


def test_open_objects_take_undeclared_keys_but_not_declared_ones_twice():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    regex = re.compile(convert_schema(schema, SchemaOptions(open_objects=True)).regex)
    assert regex.fullmatch('{"a":1,"zz":[1]}') and regex.fullmatch('{"zz":"x"}')
    assert not regex.fullmatch('{"a":1,"a":"x"}') and not regex.fullmatch('{"zz":1,"a":"x"}')


def test_any_json_depth_is_an_option():
    schema = {"type": "object", "additionalProperties": {}}
    assert re.fullmatch(
        convert_schema(schema, SchemaOptions(any_json_depth=3)).regex, '{"a":{"b":[1]}}'
    )


def test_recursion_depth_is_an_option():
    schema = FEATURES["recursive_tree_at_the_bound"][0]
    deep = '{"v":1,"kids":[{"v":2,"kids":[{"v":3}]}]}'
    assert not re.fullmatch(convert_schema(schema, SchemaOptions(recursion_depth=2)).regex, deep)
    assert re.fullmatch(convert_schema(schema, SchemaOptions(recursion_depth=3)).regex, deep)


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"const": 1}}, "contains"),
        ({"type": "object", "not": {"properties": {"a": {"pattern": "x"}}}}, "not"),
        ({"type": "number", "minimum": 0.5}, "minimum"),
        ({"type": "string", "maxLength": 100000}, "maxLength"),
    ],
)
def test_unenforceable_keyword_strict_refuses_and_lenient_reports(schema, keyword):
    with pytest.raises(ConstraintError, match=re.escape(repr(keyword))):
        make_spec(json_schema=schema, schema_mode="strict")
    spec = make_spec(json_schema=schema)  # lenient is the default
    assert keyword in spec.unenforced


def test_refs_to_other_documents_are_reported_or_refused():
    schema = {
        "type": "object",
        "properties": {"a": {"$ref": "https://example.com/s.json"}},
        "required": ["a"],
    }
    with pytest.raises(ConstraintError, match="another document"):
        make_spec(json_schema=schema, schema_mode="strict")
    assert make_spec(json_schema=schema).unenforced == ("$ref",)


def test_a_ref_to_the_documents_own_id_resolves():
    schema = {"$id": "https://x.org/s.json", "definitions": {"a": {"type": "boolean"}},
              "$ref": "https://x.org/s.json#/definitions/a"}  # fmt: skip
    assert re.fullmatch(make_spec(json_schema=schema, schema_mode="strict").regex, "true")


def test_contradictions_are_refused():
    with pytest.raises(ConstraintError, match="allows no value"):
        make_spec(json_schema={"allOf": [{"type": "string"}, {"type": "integer"}]})


def test_ecma_named_groups_in_patterns_are_enforced_and_validated():
    schema = {"type": "string", "pattern": "^(?<major>0|[1-9][0-9]*)\\.(?<minor>0|[1-9][0-9]*)$"}
    regex = re.compile(convert_schema(schema, SchemaOptions(mode="strict")).regex)
    assert regex.fullmatch('"1.10"') and not regex.fullmatch('"1.02"')
    assert validate_output(schema, '"1.10"') == {"valid": True, "error": None}
    assert validate_output(schema, '"1.02"')["valid"] is False


def test_later_keywords_apply_in_older_drafts():
    """A draft-04 schema's `const` is read as later drafts define it, by the converter and
    by the output check (a oneOf of two consts is then not always two matches)."""
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "properties": {"s": {"oneOf": [{"const": "a"}, {"const": "b"}]}}}  # fmt: skip
    regex = re.compile(convert_schema(schema).regex)
    assert regex.fullmatch('{"s":"a"}') and not regex.fullmatch('{"s":"c"}')
    assert validate_output(schema, '{"s":"a"}')["valid"] is True
    assert validate_output(schema, '{"s":"c"}')["valid"] is False


def test_a_ref_to_another_document_leaves_the_object_it_joins_open():
    schema = {"type": "object", "allOf": [{"$ref": "https://example.com/s.json"},
              {"properties": {"a": {"type": "integer"}}}]}  # fmt: skip
    converted = convert_schema(schema)
    assert converted.unenforced == ("$ref",)
    assert re.fullmatch(converted.regex, '{"a":1,"b":"x"}') and not re.fullmatch(
        converted.regex, '{"a":"x"}'
    )
    closed = {**schema, "additionalProperties": False}
    assert not re.fullmatch(convert_schema(closed).regex, '{"a":1,"b":"x"}')


def test_an_unenforceable_if_allows_what_then_or_else_allows():
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}},
              "if": {"properties": {"a": {"pattern": "x"}}}, "then": {"properties": {"c": {"type": "string"}}}}  # fmt: skip
    converted = convert_schema(schema)
    assert "if" in converted.unenforced
    assert re.fullmatch(converted.regex, '{"a":true,"c":"x"}') and re.fullmatch(
        converted.regex, '{"a":true}'
    )
    assert not re.fullmatch(converted.regex, '{"a":1}')
