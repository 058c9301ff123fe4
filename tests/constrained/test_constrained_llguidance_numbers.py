"""Numbers without bounds, as llguidance is given them: at most 16 integer digits and 10
fraction digits (as the spruce converter writes them). A plain numeric property refers to one
shared bounded definition (llguidance builds a range's lexeme per occurrence, ~0.5 ms each);
where a `$ref` from that node could not reach the root's definitions, the bounds are inline."""

from __future__ import annotations

import json

import pytest
from support import first_refused

from spruce.constrained import GrammarCompiler, make_spec
from spruce.constrained.backends.llguidance_text import schema_grammar
from spruce.constrained.schema.schema_context import SchemaOptions

NUMBERS = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "description": "how many"},
        "ratio": {"type": "number"},
        "maybe": {"type": ["integer", "null"]},
        "small": {"type": "integer", "maximum": 9},
    },
    "required": ["count", "ratio", "maybe", "small"],
}


def inner_schema(grammar: str) -> dict:
    return json.loads(grammar)["grammars"][0]["json_schema"]


def test_plain_numbers_share_one_definition_each():
    schema = inner_schema(schema_grammar(NUMBERS, SchemaOptions(), lenient=True, check=False)[0])
    props = schema["properties"]
    assert props["count"] == {"$ref": "#/$defs/spruce_bounded_integer", "description": "how many"}
    assert props["ratio"] == {"$ref": "#/$defs/spruce_bounded_number"}
    assert props["maybe"]["maximum"] == 10**16 - 1  # a list of types: bounded in place
    assert props["small"] == {"type": "integer", "maximum": 9}  # bounded by the schema itself
    assert schema["$defs"]["spruce_bounded_number"]["multipleOf"] == 1e-10


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$id": "https://x.example/a", "type": "object",
                                                "properties": {"n": {"type": "integer"}}}}},
        {"$defs": {"spruce_bounded_integer": {"type": "string"}}, "type": "object",
         "properties": {"n": {"type": "integer"}}},
    ],
    ids=["inner $id", "name taken"],
)  # fmt: skip
def test_bounds_stay_inline_where_a_shared_ref_could_miss(schema):
    text = schema_grammar(schema, SchemaOptions(), lenient=True, check=False)[0]
    assert "#/$defs/spruce_bounded" not in text and str(10**16 - 1) in text


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer)
    yield compiler
    compiler.close()


@pytest.mark.parametrize("key", ["count", "ratio", "maybe"])
def test_sixteen_integer_digits_pass_and_seventeen_do_not(compiler, tiny_tokenizer, key):
    grammar = compiler.compile(make_spec(json_schema=NUMBERS, backend="llguidance"))
    value = {"count": 1, "ratio": 0.5, "maybe": None, "small": 3}

    def accepted(number: str) -> bool:
        text = json.dumps({**value, key: 0}, separators=(",", ":")).replace(
            f'"{key}":0', f'"{key}":{number}'
        )
        refused, can_end, _ = first_refused(grammar, tiny_tokenizer, text)
        return refused is None and can_end

    assert accepted("9" * 16) and accepted("-" + "9" * 16)
    # llguidance compares bounds as doubles: 10**16 - 1 is 10**16 there, so 10**16 itself
    # passes (inline bounds alike); any other 17-digit integer does not
    assert not accepted("9" * 17) and not accepted("1" + "0" * 15 + "1")
    if key == "ratio":
        assert accepted("0." + "1" * 10) and not accepted("0." + "1" * 11)


def test_numbers_in_the_schemas_own_definitions_are_bounded_too(compiler, tiny_tokenizer):
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    schema = {"$defs": {"point": point}, "type": "object", "properties": {"p": {"$ref": "#/$defs/point"}},
              "required": ["p"]}  # fmt: skip
    grammar = compiler.compile(make_spec(json_schema=schema, backend="llguidance"))
    for number, ok in (
        ("1.5", True),
        ("0." + "1" * 10, True),
        ("0." + "1" * 11, False),
        ("9" * 17, False),
    ):
        refused, can_end, _ = first_refused(grammar, tiny_tokenizer, '{"p":{"x":' + number + "}}")
        assert (refused is None and can_end) == ok, number
