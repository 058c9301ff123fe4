"""Numbers without bounds end the same wherever a schema goes: a schema inside a structural
tag (both forms), a tool call's arguments under tool_choice "auto" (every format's strict
tag), "required" and a named function take 16 integer digits and refuse 17, as a
`json_schema` constraint does (test_constrained_llguidance_numbers.py), through the same
compiler and cursor; a tag's objects are closed as that constraint's are."""

from __future__ import annotations

import json

import pytest
from support import first_refused
from test_constrained_structural_tag import SPECIAL_CALL, XML_CALL

from spruce.constrained import GrammarCompiler, make_spec
from spruce.constrained.backends.llguidance_text import prepared_schema, schema_grammar
from spruce.constrained.convert import Conversion
from spruce.constrained.schema.schema_context import SchemaOptions
from spruce.runtime.server.openai.tool_parsers import TOOL_CALL_FORMATS
from spruce.runtime.server.openai.tool_tags import strict_auto_tag

SIXTEEN, SEVENTEEN = "9" * 16, "9" * 17
# llguidance compares bounds as doubles (10**16 passes, see the direct test): a 17-digit
# run other than 10**16 and all nines covers both ends
PASSING = (SIXTEEN, "-" + SIXTEEN, "0", "1234567890123456")
REFUSED = (SEVENTEEN, "-" + SEVENTEEN, "1" + "0" * 15 + "1", "12345678901234567")
KINDS = ("integer", "number")


def one_number(kind: str) -> dict:
    return {"type": "object", "properties": {"n": {"type": kind}}, "required": ["n"]}


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer)
    yield compiler
    compiler.close()


def accepts(compiler, tokenizer, spec, text: str) -> bool:
    refused, can_end, _ = first_refused(compiler.compile(spec), tokenizer, text)
    return refused is None and can_end


def check_bounded(compiler, tokenizer, spec, write) -> None:
    """`write(number)`: the whole output with that number text in the schema's place."""
    got = {
        number: accepts(compiler, tokenizer, spec, write(number)) for number in PASSING + REFUSED
    }
    assert got == {number: number in PASSING for number in got}


# -- the one preparing step ----------------------------------------------------------------


def test_a_nested_schema_is_written_as_a_direct_one():
    """The structural tag's %json holds what schema_grammar gives llguidance."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"},
              "c": {"type": ["integer", "null"]}, "d": {"type": "integer", "maximum": 5}}}  # fmt: skip
    direct = json.loads(schema_grammar(schema, SchemaOptions(), True, False)[0])
    direct = direct["grammars"][0]["json_schema"]
    del direct["x-guidance"]  # separators and lenient mode: the direct path's options
    prepared = prepared_schema(schema, SchemaOptions())
    assert prepared == direct and prepared["additionalProperties"] is False
    assert prepared["$defs"].keys() == {"spruce_bounded_integer", "spruce_bounded_number"}


def test_shared_definitions_only_where_used():
    strings = {"type": "object", "properties": {"s": {"type": "string"}}}
    assert prepared_schema(strings, SchemaOptions(open_objects=True)) == strings
    assert list(prepared_schema(one_number("integer"), SchemaOptions())["$defs"]) == [
        "spruce_bounded_integer"
    ]


def test_a_tag_closes_its_objects(compiler, tiny_tokenizer):
    """As a json_schema constraint does: a small model invents properties otherwise."""
    fmt = {"type": "json_schema", "json_schema": one_number("integer")}
    spec = make_spec(structural_tag={"type": "structural_tag", "format": fmt})
    assert accepts(compiler, tiny_tokenizer, spec, '{"n": 1}')
    assert not accepts(compiler, tiny_tokenizer, spec, '{"n": 1, "m": 2}')


# -- structural tags, both forms -------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_structures_and_triggers(compiler, tiny_tokenizer, kind):
    tag = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=f>", "schema": one_number(kind), "end": "</function>"}]}  # fmt: skip
    spec = make_spec(structural_tag=tag)
    check_bounded(
        compiler, tiny_tokenizer, spec, lambda n: f'Hi <function=f>{{"n": {n}}}</function>'
    )


@pytest.mark.parametrize("kind", KINDS)
def test_format_json_schema_in_a_tag(compiler, tiny_tokenizer, kind):
    fmt = {"type": "tag", "begin": "<a>", "end": "</a>",
           "content": {"type": "json_schema", "json_schema": {"type": "array", "items": {"type": kind}}}}  # fmt: skip
    spec = make_spec(structural_tag={"type": "structural_tag", "format": fmt})
    check_bounded(compiler, tiny_tokenizer, spec, lambda n: f"<a>[1, {n}]</a>")


def test_a_bare_number_schema(compiler, tiny_tokenizer):
    fmt = {"type": "json_schema", "json_schema": {"type": "integer"}}
    spec = make_spec(structural_tag={"type": "structural_tag", "format": fmt})
    check_bounded(compiler, tiny_tokenizer, spec, str)


# -- tool calls: "auto" with strict functions, every format --------------------------------


def auto_call(name: str, kind: str, number: str) -> str:
    """A call of `count` whose argument `n` is `number`, as format `name` writes it."""
    arguments = f'{{"n": {number}}}'
    if name in ("hermes", "json"):
        return f'<tool_call>\n{{"name": "count", "arguments": {arguments}}}\n</tool_call>'
    if name == "llama3_json":
        return f'{{"name": "count", "parameters": {arguments}}}'
    if name == "mistral":
        return f'[TOOL_CALLS][{{"name": "count", "arguments": {arguments}}}]'
    if name in XML_CALL:
        return XML_CALL[name]("count", "n", number)
    if name in SPECIAL_CALL:
        begin, call, end = SPECIAL_CALL[name]
        return begin + call("count", arguments) + end
    if name == "gpt-oss":
        return f"<|channel|>commentary to=functions.count <|constrain|>json<|message|>{arguments}"
    assert name == "pythonic"
    return f"[count(n={number})]"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(TOOL_CALL_FORMATS))
def test_auto_strict_calls(compiler, tiny_tokenizer, name, kind):
    functions = [{"name": "count", "parameters": one_number(kind), "strict": True}]
    tag = strict_auto_tag(TOOL_CALL_FORMATS[name], functions, parallel=True)["structural_tag"]
    spec = make_spec(structural_tag=tag)
    check_bounded(compiler, tiny_tokenizer, spec, lambda n: auto_call(name, kind, n))


# -- tool calls: "required" and a named function --------------------------------------------


def required_call(name: str, number: str) -> str:
    """One call of `count` as the required / named constraint writes it (compact JSON)."""
    call = f'{{"name":"count","arguments":{{"n":{number}}}}}'
    return f"<tool_call>\n{call}\n</tool_call>" if name == "hermes" else f"[{call}]"


@pytest.mark.parametrize("single", [False, True], ids=["required", "named"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["hermes", "json"])  # a regex, a json_schema constraint
def test_required_and_named_calls(compiler, tiny_tokenizer, name, kind, single):
    functions = [{"name": "count", "parameters": one_number(kind)}]
    constraint = TOOL_CALL_FORMATS[name].constraint(functions, single, False, Conversion())
    spec = make_spec(**constraint)

    def write(number: str) -> str:
        text = required_call(name, number)
        return text[1:-1] if name == "json" and single else text  # a named call: no array

    check_bounded(compiler, tiny_tokenizer, spec, write)
