"""A `$ref` to another document (no network to fetch it) under every backend: in lenient mode
it allows any value there and is reported as `$ref`; an object beside it stays open (the
spruce converter's reading, which llguidance's path now shares: before, llguidance refused
such a schema and `auto` fell back to the slower converter)."""

from __future__ import annotations

import json

import pytest
from spruce.constrained import ConstraintError, GrammarCompiler, make_spec
from support import first_refused

REMOTE = "https://example.com/schemas/part.json"
SCHEMA = {
    "type": "object",
    "properties": {"part": {"$ref": REMOTE}, "count": {"type": "integer"}},
    "required": ["part", "count"],
}
BESIDE = {"type": "object", "$ref": REMOTE, "properties": {"count": {"type": "integer"}}, "required": ["count"]}


@pytest.fixture(scope="module")
def tokenizer():
    from spruce.runtime.models.loading.files import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer)
    yield compiler
    compiler.close()


def accepts(grammar, tokenizer, value) -> bool:
    refused, can_end, _ = first_refused(grammar, tokenizer, json.dumps(value, separators=(",", ":")))
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
        assert accepts(grammar, tokenizer, {"part": part, "count": 3}), part
    assert not accepts(grammar, tokenizer, {"part": 1, "count": "3"})  # the rest is enforced
    assert not accepts(grammar, tokenizer, {"count": 3})  # `part` is still required


@pytest.mark.parametrize("backend", ["llguidance", "spruce"])
def test_an_object_beside_a_remote_ref_stays_open(compiler, tokenizer, backend):
    grammar = compiler.compile(make_spec(json_schema=BESIDE, backend=backend))
    assert accepts(grammar, tokenizer, {"count": 1, "other": [2]})  # the remote part may add it
    assert not accepts(grammar, tokenizer, {"count": "1"})


def test_strict_mode_refuses_a_remote_ref():
    with pytest.raises(ConstraintError, match="another document"):
        make_spec(json_schema=SCHEMA, schema_mode="strict")
