"""Auto gives a lenient JSON schema to llguidance without checking its grammar at the front
door: building the grammar checks it (a check alone costs as much as the build). The compile
then decides: llguidance's warnings become `unenforced`, and a schema llguidance refuses goes
to the spruce converter. What comes out is what the front door's own check would have made."""

from __future__ import annotations

import pytest
from support import first_refused

from spruce.constrained import ConstraintError, ConstraintSpec, GrammarCompiler, make_spec

UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
LOOKAHEAD = {"type": "string", "pattern": "^(?!foo)[a-z]+$"}  # llguidance refuses lookaround
REMOTE = {
    "type": "object",
    "properties": {"part": {"$ref": "https://example.com/p.json"}},
    "required": ["part"],
}


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer)
    yield compiler
    compiler.close()


def test_auto_leaves_the_check_to_the_compile_and_says_so():
    spec = make_spec(json_schema=UNIQUE)
    assert spec.backend == "llguidance" and spec.fallback is not None and spec.unenforced == ()
    assert spec.fallback["mode"] == "lenient"
    checked = make_spec(json_schema=UNIQUE, check=True)
    assert checked.fallback is None and checked.unenforced == ("uniqueItems",)
    assert spec == checked  # one cache key: the decided grammar serves both


@pytest.mark.parametrize(
    "options",
    [{"backend": "llguidance"}, {"schema_mode": "strict"}, {"backend": "spruce"}],
    ids=["llguidance named", "strict", "spruce named"],
)
def test_without_a_backend_to_fall_back_to_the_front_door_decides(options):
    spec = make_spec(
        json_schema=UNIQUE if options.get("schema_mode") != "strict" else {"type": "integer"},
        **options,
    )
    assert spec.fallback is None
    with pytest.raises(ConstraintError):
        make_spec(json_schema=LOOKAHEAD, backend="llguidance")


@pytest.mark.parametrize("schema", [UNIQUE, REMOTE], ids=["uniqueItems", "remote $ref"])
def test_the_compiled_spec_reports_what_the_front_door_check_would(compiler, schema):
    grammar = compiler.compile(make_spec(json_schema=schema))
    checked = make_spec(json_schema=schema, check=True)
    assert grammar.spec.backend == "llguidance" and grammar.spec.fallback is None
    assert grammar.spec.unenforced == checked.unenforced != ()


def test_a_schema_llguidance_refuses_is_compiled_by_the_spruce_converter(compiler, tiny_tokenizer):
    spec = make_spec(json_schema=LOOKAHEAD)
    assert spec.backend == "llguidance" and spec.fallback is not None
    grammar = compiler.compile(spec)
    checked = make_spec(json_schema=LOOKAHEAD, check=True)
    assert grammar.spec.backend == "spruce" and grammar.spec.regex == checked.regex != ""
    assert compiler.cached(spec) is grammar  # cached under the spec the request holds
    for text, ok in (('"bar"', True), ('"foobar"', False)):
        refused, can_end, _ = first_refused(grammar, tiny_tokenizer, text)
        assert (refused is None and can_end) == ok, text


def test_options_reach_the_fallback_conversion(compiler):
    schema = {"type": "object", "properties": {"s": LOOKAHEAD}, "required": ["s"]}
    grammar = compiler.compile(make_spec(json_schema=schema, whitespace_pattern="[ ]?"))
    spaced = make_spec(json_schema=schema, whitespace_pattern="[ ]?", check=True).regex
    assert grammar.spec.regex == spaced != make_spec(json_schema=schema, check=True).regex


def test_a_compile_error_that_is_not_a_refusal_does_not_fall_back(tiny_tokenizer):
    small = GrammarCompiler(
        tiny_tokenizer, grammar_bytes=1000
    )  # under llguidance's matcher estimate
    try:
        with pytest.raises(ConstraintError, match="memory budget"):
            small.compile(make_spec(json_schema=UNIQUE))
    finally:
        small.close()


def test_the_spec_crosses_the_process_border_with_its_fallback():
    spec = make_spec(json_schema=LOOKAHEAD, whitespace_pattern="[ ]?")
    again = ConstraintSpec(**spec.to_dict())
    assert again == spec and again.fallback == spec.fallback and again.grammar == spec.grammar
