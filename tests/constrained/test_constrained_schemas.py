"""JSON schemas under random logits: the constraint alone must make every output valid."""

from __future__ import annotations

import enum
import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from test_constrained_helpers import (  # noqa: F401  (tiny_compiler is a fixture)
    SHARED_SCHEMAS,
    assert_stopped_by_automaton,
    assert_valid_json,
    generate,
    tiny_compiler,
)

from spruce.constrained import make_spec


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    name: str = Field(max_length=12)


class Person(BaseModel):
    point: tuple[int, str]
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    color: Color
    nickname: str | None = Field(default=None, max_length=8)
    pets: list[Pet] = Field(max_length=2)
    height: float = Field(gt=0, lt=3)


OWN_SCHEMAS = {
    "pydantic_person": Person.model_json_schema(),
    "type_list_and_bounds": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "exclusiveMinimum": -273, "maximum": 100},
            "delta": {"type": ["integer", "null"], "minimum": -50, "maximum": -5},
            "flag": {"type": ["boolean", "string"], "maxLength": 3},
        },
        "required": ["temperature", "delta", "flag"],
    },
    "tuple_and_formats": {
        "type": "object",
        "properties": {
            "pair": {"prefixItems": [{"type": "integer"}, {"const": 'x"y'}]},
            "id": {"type": "string", "format": "uuid"},
            "at": {"type": "string", "format": "date-time"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}.[0-9]$"},
        },
        "required": ["pair", "id", "at", "code"],
    },
    "unconstrained_values": {
        "type": "object",
        "properties": {
            "anything": {},
            "obj": {"type": "object"},
            "arr": {"type": "array", "maxItems": 3},
            "map": {"type": "object", "additionalProperties": {"description": "any"}},
        },
        "required": ["anything", "obj", "arr", "map"],
    },
    "free_object_values": {
        "type": "object",
        "properties": {"meta": {"type": "object", "additionalProperties": {"type": "integer"}}},
        "required": ["meta"],
    },
}


def _load(path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", SHARED_SCHEMAS, ids=lambda p: p.stem)
@pytest.mark.parametrize("jump_forward", [False, True], ids=["plain", "jump"])
def test_shared_schema_outputs_validate(tiny_compiler, tiny_tokenizer, path, jump_forward):
    schema = _load(path)
    grammar = tiny_compiler.compile(make_spec(json_schema=schema))
    for seed in range(2):
        gen = generate(grammar, tiny_tokenizer, seed, jump_forward=jump_forward)
        assert_stopped_by_automaton(gen)
        assert_valid_json(gen.text, schema)
        if jump_forward:
            assert gen.jumps, "a schema with fixed keys always has forced text"


@pytest.mark.parametrize("name", list(OWN_SCHEMAS))
@pytest.mark.parametrize("jump_forward", [False, True], ids=["plain", "jump"])
def test_own_schema_outputs_validate(tiny_compiler, tiny_tokenizer, name, jump_forward):
    schema = OWN_SCHEMAS[name]
    grammar = tiny_compiler.compile(make_spec(json_schema=schema))
    for seed in range(3):
        gen = generate(grammar, tiny_tokenizer, 100 + seed, jump_forward=jump_forward)
        assert_stopped_by_automaton(gen)
        assert_valid_json(gen.text, schema)


def test_pydantic_class_and_json_string_give_the_same_spec():
    from_class = make_spec(json_schema=Person)
    from_text = make_spec(json_schema=json.dumps(Person.model_json_schema()))
    assert from_class == from_text and hash(from_class) == hash(from_text)
