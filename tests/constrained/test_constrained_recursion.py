"""Recursive JSON schemas without a depth bound (issue 29, "a depth-8 recursive schema is
enforced"): a tree and an expression AST (anyOf over recursive $refs) through backend "auto"
and "llguidance", fed token by token on the bundled SmolLM2 tokenizer in compact JSON. Valid
instances (checked with jsonschema) are accepted to the end, broken ones are refused at the
token that holds the first wrong character; free values `{}` nest 6 deep. Backend "spruce"
still unrolls recursion (SchemaOptions.recursion_depth), so it refuses the depth-8 tree.
Also here: a `$ref` to another document, under every backend."""

from __future__ import annotations

import json

import jsonschema
import pytest
from support import bundled_gguf_path, first_refused

from spruce.constrained import ConstraintError, GrammarCompiler, make_spec

TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["value", "children"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
EXPR = {
    "$defs": {
        "expr": {"anyOf": [{"$ref": "#/$defs/num"}, {"$ref": "#/$defs/neg"}, {"$ref": "#/$defs/bin"}]},
        "num": {"type": "object", "properties": {"kind": {"const": "num"}, "value": {"type": "integer"}},
                "required": ["kind", "value"], "additionalProperties": False},
        "neg": {"type": "object", "properties": {"kind": {"const": "neg"}, "arg": {"$ref": "#/$defs/expr"}},
                "required": ["kind", "arg"], "additionalProperties": False},
        "bin": {"type": "object", "properties": {"kind": {"const": "bin"}, "op": {"enum": ["+", "-", "*", "/"]},
                                                 "left": {"$ref": "#/$defs/expr"}, "right": {"$ref": "#/$defs/expr"}},
                "required": ["kind", "op", "left", "right"], "additionalProperties": False},
    },
    "$ref": "#/$defs/expr",
}  # fmt: skip
FREE = {
    "type": "object",
    "properties": {"data": {}},
    "required": ["data"],
    "additionalProperties": False,
}
DEPTH = 8


def tree(depth: int, value: int = 0) -> dict:
    """A chain of `depth` nodes (the root is depth 1); the node at depth d holds value + d."""
    return {"value": value + 1, "children": [] if depth == 1 else [tree(depth - 1, value + 1)]}


def expr(depth: int) -> dict:
    """An AST `depth` nodes deep, alternating bin and neg, ending in a num."""
    if depth == 1:
        return {"kind": "num", "value": 7}
    if depth % 2:
        return {"kind": "neg", "arg": expr(depth - 1)}
    return {
        "kind": "bin",
        "op": "*",
        "left": {"kind": "num", "value": depth},
        "right": expr(depth - 1),
    }


def free_value(depth: int) -> object:
    """A JSON value `depth` containers deep, objects and arrays in turn."""
    if depth == 0:
        return "leaf"
    inner = free_value(depth - 1)
    return {"k": inner, "n": None} if depth % 2 else [1.5, inner, True]


def compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def at_depth(root: dict, depth: int) -> dict:
    node = root
    for _ in range(depth - 1):
        node = node["children"][0]
    return node


@pytest.fixture(scope="module")
def tokenizer():
    from spruce.runtime.models.loading.files import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer)
    yield compiler
    compiler.close()


def token_at(tokenizer, ids: list[int], offset: int) -> int:
    """The index of the token whose text covers character `offset` (ASCII text)."""
    end = 0
    for i, token in enumerate(ids):
        end += len(tokenizer.decode([token]))
        if end > offset:
            return i
    raise AssertionError(f"offset {offset} is past the text")


def compiled(compiler, schema: dict, backend: str):
    spec = make_spec(json_schema=schema, backend=backend)
    assert spec.backend == "llguidance" and spec.unenforced == (), spec.to_dict()
    return compiler.compile(spec)


def assert_accepted(grammar, tokenizer, schema: dict, value: object) -> None:
    jsonschema.validate(value, schema)
    text = compact(value)
    refused, can_end, _ = first_refused(grammar, tokenizer, text)
    assert refused is None and can_end, text


def assert_refused_at(grammar, tokenizer, schema: dict, text: str, offset: int) -> None:
    """`text` is invalid and its first wrong character is at `offset`: the token holding it is
    the first one refused."""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text), schema)
    refused, _, ids = first_refused(grammar, tokenizer, text)
    assert refused == token_at(tokenizer, ids, offset), (text, offset, refused)


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_a_depth_8_tree_is_accepted_to_its_end(compiler, tokenizer, backend):
    grammar = compiled(compiler, TREE, backend)
    value = tree(DEPTH)
    assert at_depth(value, DEPTH)["children"] == []  # eight nodes deep, no more
    assert_accepted(grammar, tokenizer, TREE, value)
    assert_accepted(
        grammar, tokenizer, TREE, {"value": -3, "children": [tree(DEPTH - 1), tree(2), tree(1)]}
    )
    refused, can_end, _ = first_refused(grammar, tokenizer, compact(value)[:-1])
    assert refused is None and not can_end  # one bracket short: a prefix, not an end


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_a_wrong_type_at_depth_8_is_refused_at_its_token(compiler, tokenizer, backend):
    grammar = compiled(compiler, TREE, backend)
    value = tree(DEPTH)
    at_depth(value, DEPTH)["value"] = "8"
    text = compact(value)
    assert_refused_at(grammar, tokenizer, TREE, text, text.index('"8"'))


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_a_missing_required_key_at_depth_7_is_refused_at_its_token(compiler, tokenizer, backend):
    grammar = compiled(compiler, TREE, backend)
    value = tree(DEPTH)
    del at_depth(value, DEPTH - 1)["children"]  # {"value":7} closes without its children
    text = compact(value)
    assert_refused_at(grammar, tokenizer, TREE, text, text.index('{"value":7}') + len('{"value":7'))


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_an_expression_ast_with_anyof_over_recursive_refs(compiler, tokenizer, backend):
    grammar = compiled(compiler, EXPR, backend)
    assert_accepted(grammar, tokenizer, EXPR, expr(DEPTH))
    assert_accepted(
        grammar, tokenizer, EXPR, {"kind": "bin", "op": "-", "left": expr(DEPTH), "right": expr(3)}
    )
    wrong_op = compact(expr(DEPTH)).replace('"op":"*"', '"op":"^"', 1)
    assert_refused_at(grammar, tokenizer, EXPR, wrong_op, wrong_op.index("^"))
    mixed = compact(expr(DEPTH)).replace('{"kind":"num","value":7}', '{"kind":"num","arg":7}')
    assert_refused_at(
        grammar, tokenizer, EXPR, mixed, mixed.index('"arg":7') + 1
    )  # a num has no arg


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_free_values_nest_6_deep(compiler, tokenizer, backend):
    for schema in ({}, FREE):
        grammar = compiled(compiler, schema, backend)
        value = free_value(6)
        assert_accepted(grammar, tokenizer, schema, value if schema == {} else {"data": value})


def test_the_spruce_backend_still_unrolls_recursion(compiler, tokenizer):
    """Backend "spruce" writes the tree as a regex, recursion unrolled to
    SchemaOptions.recursion_depth (4): a depth-4 tree is accepted, the depth-8 one refused."""
    spec = make_spec(json_schema=TREE, backend="spruce")
    assert spec.backend == "spruce"
    grammar = compiler.compile(spec)
    assert_accepted(grammar, tokenizer, TREE, tree(4))
    refused, _, _ = first_refused(grammar, tokenizer, compact(tree(DEPTH)))
    assert refused is not None


# -- the bundled model --------------------------------------------------------------------


@pytest.mark.slow
def test_the_bundled_model_writes_a_tree_that_validates(compiler):
    from spruce.runtime import Engine

    if bundled_gguf_path() is None:
        pytest.skip("the bundled model is not installed")
    engine = Engine(num_threads=1, kv_memory_gb=0.5)
    prompt = engine.apply_chat_template(
        [
            {
                "role": "user",
                "content": "Write a tree of numbers as JSON: each node has a value and children.",
            }
        ]
    )
    out = engine.generate(prompt, {"json_schema": TREE, "temperature": 0, "max_new_tokens": 200})
    finish = out["meta_info"]["finish_reason"]["type"]
    if finish == "stop":
        jsonschema.validate(json.loads(out["text"]), TREE)
        return
    assert finish == "length", out
    spec = make_spec(json_schema=TREE)
    assert spec.backend == "llguidance"
    cursor = compiler.compile(spec).cursor()
    assert all(cursor.accept_token(t) for t in out["output_ids"]), out["text"]


# -- a $ref to another document (no network to fetch it) -------------------------------------
# Lenient mode allows any value there and reports `$ref`; an object beside it stays open (the
# spruce converter's reading, which the llguidance path shares).

REMOTE = "https://example.com/schemas/part.json"
SCHEMA = {
    "type": "object",
    "properties": {"part": {"$ref": REMOTE}, "count": {"type": "integer"}},
    "required": ["part", "count"],
}
BESIDE = {
    "type": "object",
    "$ref": REMOTE,
    "properties": {"count": {"type": "integer"}},
    "required": ["count"],
}


def accepts_value(grammar, tokenizer, value) -> bool:
    refused, can_end, _ = first_refused(
        grammar, tokenizer, json.dumps(value, separators=(",", ":"))
    )
    return refused is None and can_end


@pytest.mark.parametrize("backend", ["auto", "llguidance", "spruce"])
def test_a_remote_ref_allows_any_value_and_is_reported(compiler, tokenizer, backend):
    spec = make_spec(json_schema=SCHEMA, backend=backend)
    assert spec.backend == ("spruce" if backend == "spruce" else "llguidance")
    assert "$ref" in spec.unenforced
    grammar = compiler.compile(spec)
    parts = [1, "x", [1, {"y": None}], {"deep": [True]}]
    if backend != "spruce":  # the converter unrolls free values to depth 2
        parts.append({"deep": {"er": [{"est": True}]}})
    for part in parts:
        assert accepts_value(grammar, tokenizer, {"part": part, "count": 3}), part
    assert not accepts_value(grammar, tokenizer, {"part": 1, "count": "3"})  # the rest is enforced
    assert not accepts_value(grammar, tokenizer, {"count": 3})  # `part` is still required


@pytest.mark.parametrize("backend", ["llguidance", "spruce"])
def test_an_object_beside_a_remote_ref_stays_open(compiler, tokenizer, backend):
    grammar = compiler.compile(make_spec(json_schema=BESIDE, backend=backend))
    assert accepts_value(
        grammar, tokenizer, {"count": 1, "other": [2]}
    )  # the remote part may add it
    assert not accepts_value(grammar, tokenizer, {"count": "1"})


def test_strict_mode_refuses_a_remote_ref():
    with pytest.raises(ConstraintError, match="another document"):
        make_spec(json_schema=SCHEMA, schema_mode="strict")
