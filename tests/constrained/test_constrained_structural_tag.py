"""Structural tags -> llguidance Lark (constrained/backends/structural_tag.py), checked with
llguidance's own matcher on the bundled SmolLM2 tokenizer, token by token: each format type,
both forms, special tokens, every tool-call format's auto + strict tag, and errors that name
the field."""

from __future__ import annotations

import json

import llguidance
import pytest

from spruce.constrained.backends.structural_tag import (
    MAX_DEPTH,
    MAX_FORMATS,
    structural_tag_to_lark,
)
from spruce.constrained.core.errors import ConstraintError
from spruce.runtime.server.openai.tool_parsers import TOOL_CALL_FORMATS
from spruce.runtime.server.openai.tool_tags import strict_auto_tag

ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
NUMBER = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}
FUNCTIONS = [
    {"name": "get_weather", "parameters": ARGS, "strict": True},
    {"name": "count", "parameters": NUMBER, "strict": True},
]
IM_START = {"<|im_start|>": 1}  # a special token of the bundled vocabulary


@pytest.fixture(scope="module")
def tokenizer():
    from spruce.constrained.automaton.vocab import TokenVocabulary
    from spruce.constrained.backends.llguidance import llg_tokenizer
    from spruce.runtime.models.loading.files import load_tokenizer

    tok = load_tokenizer()
    return tok, llg_tokenizer(TokenVocabulary(tok))


def outcome(tokenizer, lark: str, text: str | list[int]) -> str:
    """ "accepted" (the whole text, and the grammar may end there), "prefix" (the text, but
    not the end) or "refused" (a token of it), fed token by token."""
    tok, llg_tok = tokenizer
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    assert llguidance.LLMatcher.validate_grammar(grammar, llg_tok) == ""
    matcher = llguidance.LLMatcher(llg_tok, grammar, log_level=0)
    ids = text if isinstance(text, list) else tok.encode(text, add_special_tokens=False)
    for token in ids:
        if not matcher.consume_token(token):
            return "refused"
    return "accepted" if matcher.is_accepting() else "prefix"


def check(tokenizer, fmt: dict, cases: dict[str, str], special: dict | None = None) -> None:
    lark = structural_tag_to_lark({"type": "structural_tag", "format": fmt}, special)
    got = {text: outcome(tokenizer, lark, text) for text in cases}
    assert got == cases, lark


def hermes_call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


# -- each format type -----------------------------------------------------------------------


def test_const_string(tokenizer):
    check(
        tokenizer,
        {"type": "const_string", "value": 'Hi "you"\n'},
        {'Hi "you"\n': "accepted", "Hi you": "refused"},
    )


def test_json_schema(tokenizer):
    check(tokenizer, {"type": "json_schema", "json_schema": ARGS},
          {'{"city": "Oslo"}': "accepted", '{"city": 3}': "refused", '{"city": "Oslo", "x": 1}': "refused"})  # fmt: skip


def test_grammar_is_gbnf(tokenizer):
    check(tokenizer, {"type": "grammar", "grammar": 'root ::= "Hello" | "Hi" [0-9]+'},
          {"Hi42": "accepted", "Hello": "accepted", "Hey": "refused"})  # fmt: skip


def test_regex(tokenizer):
    check(
        tokenizer,
        {"type": "regex", "pattern": r"[0-9]{3}/x"},
        {"123/x": "accepted", "12a": "refused", "12": "prefix"},
    )


def test_sequence_and_or(tokenizer):
    fmt = {"type": "sequence", "elements": [
        {"type": "or", "elements": [{"type": "const_string", "value": "yes"}, {"type": "const_string", "value": "no"}]},
        {"type": "const_string", "value": "!"},
    ]}  # fmt: skip
    check(
        tokenizer,
        fmt,
        {"yes!": "accepted", "no!": "accepted", "maybe!": "refused", "yes": "prefix"},
    )


def test_tag_with_any_text_runs_to_its_end(tokenizer):
    think = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
    fmt = {"type": "sequence", "elements": [think, {"type": "const_string", "value": "ok"}]}
    cases = {
        "<think>a < b</think>ok": "accepted",
        "<think>a</think>x": "refused",
        "<think>a": "prefix",
    }
    check(tokenizer, fmt, cases)


def test_tag_with_several_ends(tokenizer):
    fmt = {
        "type": "tag",
        "begin": "(",
        "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
        "end": [")", "]"],
    }
    check(tokenizer, fmt, {"(12)": "accepted", "(12]": "accepted", "(12}": "refused"})


def test_any_text_excludes(tokenizer):
    check(tokenizer, {"type": "any_text", "excludes": ["forbidden"]},
          {"all fine here": "accepted", "this is forbidden": "refused"})  # fmt: skip


def test_tags_with_separator(tokenizer):
    tag = {
        "begin": "<",
        "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
        "end": ">",
    }
    fmt = {"type": "tags_with_separator", "tags": [tag], "separator": ","}
    check(tokenizer, fmt, {"": "accepted", "<1>,<2>,<3>": "accepted", "<1>;<2>": "refused"})
    check(tokenizer, {**fmt, "at_least_one": True}, {"": "prefix", "<1>": "accepted"})
    check(tokenizer, {**fmt, "stop_after_first": True}, {"<1>": "accepted", "<1>,": "refused"})


# -- triggered tags ----------------------------------------------------------------------------

CALL_TAGS = TOOL_CALL_FORMATS["hermes"].structural_tag(FUNCTIONS, parallel=True)["format"]


def test_triggered_tags_free_text_and_calls(tokenizer):
    one, two = hermes_call("get_weather", {"city": "Oslo"}), hermes_call("count", {"n": 2})
    cases = {
        "Just text, no call.": "accepted",
        f"Let me look. {one} And more: {two} Done.": "accepted",  # text before, between, after
        one + two: "accepted",  # two calls in a row
        hermes_call("get_weather", {"city": 7}): "refused",  # a wrong argument
        hermes_call("unknown", {}): "refused",
        "text <tool_call> not a call": "refused",  # a trigger always starts its tag
    }
    check(tokenizer, CALL_TAGS, cases)


def test_triggered_tags_flags(tokenizer):
    one = hermes_call("count", {"n": 1})
    check(
        tokenizer,
        {**CALL_TAGS, "at_least_one": True},
        {"text first": "refused", one + " then text": "accepted"},
    )
    check(
        tokenizer,
        {**CALL_TAGS, "stop_after_first": True},
        {"hi " + one: "accepted", one + one: "refused", one + "x": "refused"},
    )
    both = {**CALL_TAGS, "at_least_one": True, "stop_after_first": True}
    check(tokenizer, both, {one: "accepted", one + " ": "refused", "x": "refused"})


def test_triggered_tags_inside_a_tag_stop_at_its_end(tokenizer):
    region = {"type": "tag", "begin": "<r>", "content": CALL_TAGS, "end": "</r>"}
    fmt = {"type": "sequence", "elements": [region, {"type": "const_string", "value": "!"}]}
    one = hermes_call("count", {"n": 1})
    check(
        tokenizer,
        fmt,
        {f"<r>a {one} b</r>!": "accepted", "<r>a</r>b": "refused", "<r>a</r>!": "accepted"},
    )


def test_older_form_structures_and_triggers(tokenizer):
    tag = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=count>", "schema": NUMBER, "end": "</function>"},
        {"begin": "<function=get_weather>", "schema": json.dumps(ARGS), "end": "</function>"},
    ]}  # fmt: skip
    lark = structural_tag_to_lark(json.dumps(tag))
    assert outcome(tokenizer, lark, 'hi <function=count>{"n": 3}</function> bye') == "accepted"
    assert outcome(tokenizer, lark, 'hi <function=count>{"n": "3"}') == "refused"


def test_special_token_trigger_is_the_token(tokenizer):
    tok, _ = tokenizer
    fmt = {"type": "triggered_tags", "triggers": ["<|im_start|>"], "tags": [
        {"begin": "<|im_start|>call ", "content": {"type": "json_schema", "json_schema": NUMBER}, "end": "<|im_start|>"}]}  # fmt: skip
    lark = structural_tag_to_lark({"type": "structural_tag", "format": fmt}, IM_START)
    assert "<[1]>" in lark
    call = tok.encode('text<|im_start|>call {"n": 1}<|im_start|> more', add_special_tokens=False)
    assert 1 in call and outcome(tokenizer, lark, call) == "accepted"
    spelled = [
        t
        for piece in ("text", "<|", "im", "_start", "|>")
        for t in tok.encode(piece, add_special_tokens=False)
    ]
    assert (
        outcome(tokenizer, lark, spelled) == "accepted"
    )  # plain text: the token's spelling is no trigger
    assert (
        outcome(tokenizer, lark, spelled + tok.encode("call", add_special_tokens=False))
        == "accepted"
    )
    assert (
        outcome(tokenizer, lark, tok.encode("x<|im_start|>oops", add_special_tokens=False))
        == "refused"
    )


# -- every tool-call format's auto + strict tag -------------------------------------------


def _tool_outputs(name: str) -> dict[str, str]:
    if name in ("hermes", "json"):
        one, two = hermes_call("get_weather", {"city": "Oslo"}), hermes_call("count", {"n": 2})
        return {
            f"Sure. {one} {two} ok": "accepted",
            hermes_call("count", {"n": "2"}): "refused",
            "No call.": "accepted",
        }
    if name == "llama3_json":
        one, two = (
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            '{"name": "count", "parameters": {"n": 2}}',
        )
        return {f"{one}; {two}": "accepted", '{"name": "count", "parameters": {"n": "x"}}': "refused",
                "No call.": "accepted", "<|python_tag|>" + one: "accepted", '{"other": 1}': "refused"}  # fmt: skip
    if name == "mistral":
        one, two = (
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
            '{"name": "count", "arguments": {"n": 2}}',
        )
        return {f"[TOOL_CALLS][{one}, {two}]": "accepted", f"[{one}]": "accepted", "No call.": "accepted",
                '[{"name": "count", "arguments": {"n": null}}]': "refused", f"[{one}] more": "refused"}  # fmt: skip
    if name in XML_CALL:
        one, two, bad = (XML_CALL[name](*c) for c in (("get_weather", "city", "Oslo"), ("count", "n", "2"), ("count", "n", "x")))  # fmt: skip
        return {f"Sure. {one} {two} ok": "accepted", bad: "refused", "No call.": "accepted"}
    if name in SPECIAL_CALL:
        begin, call, end = SPECIAL_CALL[name]
        one, two = call("get_weather", '{"city": "Oslo"}'), call("count", '{"n": 2}')
        between = "\n" if name == "deepseek_v3" else ""  # V3's template: a newline between calls
        return {f"Sure. {begin}{one}{between}{two}{end} ok": "accepted", "No call.": "accepted",
                begin + call("count", '{"n": "2"}') + end: "refused"}  # fmt: skip
    if name == "gpt-oss":  # a commentary message to a function, which ends the turn
        head = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}"
        call = head.format
        return {"Sure. " + call("get_weather", '{"city": "Oslo"}'): "accepted", "No call.": "accepted",
                call("count", '{"n": "2"}'): "refused"}  # fmt: skip
    assert name == "pythonic"
    return {'[get_weather(city="Oslo"), count(n=2)]': "accepted", "[count(n=2.5)]": "refused",
            "No call.": "accepted", "[count(m=1)]": "refused"}  # fmt: skip


# A call f(k=v) in the XML-like formats (tool_formats_xml), as their templates write it.
XML_CALL = {
    "qwen3_coder": lambda f, k, v: f"<tool_call>\n<function={f}>\n<parameter={k}>\n{v}\n</parameter>\n</function>\n</tool_call>",
    "glm45": lambda f, k, v: f"<tool_call>{f}\n<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n</tool_call>",
    "minimax_m2": lambda f, k, v: f'<minimax:tool_call>\n<invoke name="{f}">\n<parameter name="{k}">{v}</parameter>\n</invoke>\n</minimax:tool_call>',
}  # fmt: skip
DS = {w: f"<\uff5ctool\u2581{w.replace('_', chr(0x2581))}\uff5c>" for w in ("calls_begin", "calls_end", "call_begin", "call_end", "sep")}  # fmt: skip
# (section begin, a call of f with arguments a, section end) in the special-token formats.
SPECIAL_CALL = {
    "deepseek_v3": (DS["calls_begin"], lambda f, a: f"{DS['call_begin']}function{DS['sep']}{f}\n```json\n{a}\n```{DS['call_end']}", DS["calls_end"]),
    "deepseek_v31": (DS["calls_begin"], lambda f, a: f"{DS['call_begin']}{f}{DS['sep']}{a}{DS['call_end']}", DS["calls_end"]),
    "kimi_k2": ("<|tool_calls_section_begin|>", lambda f, a: f"<|tool_call_begin|>functions.{f}:0<|tool_call_argument_begin|>{a}<|tool_call_end|>", "<|tool_calls_section_end|>"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TOOL_CALL_FORMATS))
def test_tool_format_auto_strict(tokenizer, name):
    constraint = strict_auto_tag(TOOL_CALL_FORMATS[name], FUNCTIONS, parallel=True)
    lark = structural_tag_to_lark(constraint["structural_tag"])
    cases = _tool_outputs(name)
    assert {text: outcome(tokenizer, lark, text) for text in cases} == cases


def test_auto_needs_a_strict_function_and_frees_the_others(tokenizer):
    loose = [{**f, "strict": False} for f in FUNCTIONS]
    assert strict_auto_tag(TOOL_CALL_FORMATS["hermes"], loose, parallel=True) is None
    mixed = [FUNCTIONS[0], {**FUNCTIONS[1], "strict": None}]
    lark = structural_tag_to_lark(
        strict_auto_tag(TOOL_CALL_FORMATS["hermes"], mixed, True)["structural_tag"]
    )
    assert outcome(tokenizer, lark, hermes_call("count", {"anything": [1]})) == "accepted"
    assert outcome(tokenizer, lark, hermes_call("get_weather", {"town": "x"})) == "refused"


def test_one_call_when_not_parallel(tokenizer):
    tag = TOOL_CALL_FORMATS["hermes"].structural_tag(FUNCTIONS, parallel=False)
    one = hermes_call("count", {"n": 1})
    assert outcome(tokenizer, structural_tag_to_lark(tag), one + one) == "refused"


# -- errors name the field; bounds -----------------------------------------------------------

TAG = {"begin": "<a>", "content": {"type": "const_string", "value": "x"}, "end": "</a>"}


@pytest.mark.parametrize(
    "fmt, message",
    [
        ({"type": "triggered_tags", "triggers": ["<a"], "tags": [TAG, {**TAG, "begin": 3}]},
         "structural_tag.format.tags[1].begin must be a string"),
        ({"type": "triggered_tags", "triggers": ["<b"], "tags": [TAG]},
         "structural_tag.format.tags[0].begin must start with exactly one of"),
        ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "const_string", "value": "x"}]},
         "structural_tag.format.elements[0]: any_text and triggered_tags have no end"),
        ({"type": "or", "elements": []}, "structural_tag.format.elements must not be empty"),
        ({"type": "json_schema", "json_schema": [1]}, "structural_tag.format.json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"type": "frobnicate"}}, "structural_tag.format.json_schema:"),
        ({"type": "grammar", "grammar": 'root ::= "a'}, "structural_tag.format.grammar: line 1"),
        ({"type": "regex", "pattern": "[a-"}, "structural_tag.format.pattern:"),
        ({"type": "tag", "begin": "<t>", "content": {"type": "any_text"}, "end": ""},
         "structural_tag.format.end must be non-empty when the content is any_text"),
        ({"type": "tag", "begin": "<t>", "content": {"type": "nope"}, "end": "x"},
         "structural_tag.format.content.type must be one of"),
        ({"type": "tags_with_separator", "tags": [TAG], "separator": ",", "at_least_one": "yes"},
         "structural_tag.format.at_least_one must be a boolean"),
        ({"type": "any_text", "excludes": [""]}, "structural_tag.format.excludes must be non-empty strings"),
        ({"valueless": 1}, "structural_tag.format needs a 'type'"),
    ],
)  # fmt: skip
def test_errors_name_the_field(fmt, message):
    with pytest.raises(ConstraintError, match=None) as error:
        structural_tag_to_lark({"type": "structural_tag", "format": fmt})
    assert message in str(error.value)


@pytest.mark.parametrize(
    "tag, message",
    [
        ([], "structural_tag must be an object"),
        ({"type": "other", "format": TAG}, "structural_tag.type must be 'structural_tag'"),
        ({"type": "structural_tag"}, "structural_tag needs a 'format'"),
        ({"structures": [{"begin": "<a>", "schema": "{bad", "end": "</a>"}], "triggers": ["<a"]},
         "structural_tag.structures[0].schema is not valid JSON"),
        ({"structures": [TAG], "triggers": "<a"}, "structural_tag.triggers must be a list of strings"),
        ("{not json", "structural_tag is not valid JSON"),
    ],
)  # fmt: skip
def test_errors_of_the_envelope(tag, message):
    with pytest.raises(ConstraintError) as error:
        structural_tag_to_lark(tag)
    assert message in str(error.value)


def test_depth_and_size_are_bounded():
    deep: dict = {"type": "const_string", "value": "x"}
    for _ in range(MAX_DEPTH + 1):
        deep = {"type": "sequence", "elements": [deep]}
    with pytest.raises(ConstraintError, match=f"nests formats over {MAX_DEPTH} deep"):
        structural_tag_to_lark({"format": deep})
    wide = {
        "type": "or",
        "elements": [{"type": "const_string", "value": str(i)} for i in range(MAX_FORMATS)],
    }
    with pytest.raises(ConstraintError, match=f"has over {MAX_FORMATS} formats"):
        structural_tag_to_lark({"format": wide})
