"""The XML-like tool-call formats (tool_formats_xml: qwen3_coder, glm45, minimax_m2), no
model: each family's transcript as its chat template writes it parsed into calls and content,
whole and streamed (char by char, random chunks), values typed by the function's schema,
malformed calls returned as text, and the required / named / strict constraints accepting
calls that parse back to the same call."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from spruce.constrained.convert import Conversion
from spruce.constrained.spec import make_spec
from spruce.runtime.server.openai.chat_prompt import ToolPlan
from spruce.runtime.server.openai.schemas import ChatRequest
from spruce.runtime.server.openai.tool_parsers import TOOL_CALL_FORMATS

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "where": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "unit": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city"],
}
FUNCTIONS = [
    {"name": "get_weather", "parameters": PARAMS},
    {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
]
CODE = 'def f(x):\n    return x < 2 and "</p>"\n'  # a string value with markup and newlines
WEATHER = {"city": "Paris", "days": 3, "metric": True, "where": {"lat": 48.9}, "tags": ["a", "b"]}

# (format, output as the family's template writes it, content, calls as (name, arguments))
GOLDEN = [
    (
        "qwen3_coder",
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
        '<parameter=where>\n{"lat": 48.9}\n</parameter>\n<parameter=tags>\n["a", "b"]\n'
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n"
        "</tool_call>",
        "I'll check.",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (
        "qwen3_coder",
        f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{CODE}\n</parameter>\n"
        "<parameter=days>\nsoon\n</parameter>\n<parameter=extra>\n12\n</parameter>\n</function>\n"
        "</tool_call>",
        None,  # a value not of its type stays text; an undeclared one is a string
        [("get_weather", {"city": CODE, "days": "soon", "extra": "12"})],
    ),
    (
        "glm45",
        "Let me see.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n"
        "<arg_value>true</arg_value>\n<arg_key>where</arg_key>\n"
        '<arg_value>{"lat": 48.9}</arg_value>\n<arg_key>tags</arg_key>\n'
        '<arg_value>["a", "b"]</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>',
        "Let me see.",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (  # GLM-4.7 writes no newlines
        "glm45",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>12</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call> done",
        "done",
        [("get_weather", {"city": "12", "days": 2})],
    ),
    (
        "minimax_m2",
        'Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
        '</parameter>\n<parameter name="days">3</parameter>\n<parameter name="metric">true'
        '</parameter>\n<parameter name="where">{"lat": 48.9}</parameter>\n'
        '<parameter name="tags">["a", "b"]</parameter>\n</invoke>\n<invoke name="get_time">\n'
        "</invoke>\n</minimax:tool_call>",
        "Sure.",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (
        "minimax_m2",
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
        f"{CODE}</parameter>\n</invoke>\n</minimax:tool_call>",
        None,
        [("get_weather", {"city": CODE})],
    ),
]
NAMES = ("qwen3_coder", "glm45", "minimax_m2")


def plan(fmt: str, choice: str = "auto", parallel: bool = True) -> ToolPlan:
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    req = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools,
                      tool_choice=choice, parallel_tool_calls=parallel)  # fmt: skip
    return ToolPlan.of(req, TOOL_CALL_FORMATS[fmt])


def named(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(tool_plan: ToolPlan, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls as (name, arguments text)) of a stream; each call's first delta
    carries its name, the next ones only pieces of its arguments."""
    stream = tool_plan.stream()
    out = [stream.feed(p) for p in pieces] + [stream.finish()]
    content = "".join(c for c, _ in out)
    joined: dict[int, list[str]] = {}
    for delta in (d for _, deltas in out for d in deltas):
        if delta["index"] not in joined:
            assert delta["function"]["name"] and delta["id"].startswith("call_")
            joined[delta["index"]] = [delta["function"]["name"], ""]
        else:
            assert "name" not in delta["function"]
        joined[delta["index"]][1] += delta["function"]["arguments"]
    return content, [tuple(joined[i]) for i in sorted(joined)]


def chunks(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        out.append(text[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("fmt, text, content, expected", GOLDEN)
def test_golden_transcripts_whole_and_streamed(fmt, text, content, expected):
    tool_plan = plan(fmt)
    got_content, calls = tool_plan.calls_from(text)
    assert got_content == content and named(calls) == expected
    for pieces in ([text], list(text), chunks(text, 1), chunks(text, 2)):
        streamed_content, streamed_calls = streamed(tool_plan, pieces)
        assert [(n, json.loads(a)) for n, a in streamed_calls] == expected
        assert streamed_content.strip() == (content or "")


def test_string_arguments_stream_piece_by_piece():
    """A string value's JSON grows with the text; a typed one comes whole; the name first."""
    fmt = TOOL_CALL_FORMATS["qwen3_coder"].bind(FUNCTIONS)
    text = GOLDEN[0][1]
    seen = [fmt.scan(text[:n], final=False).calls for n in range(len(text) + 1)]
    firsts = [calls[0].arguments for calls in seen if calls]
    assert all(b.startswith(a) for a, b in itertools.pairwise(firsts))
    assert '{"city": "Par' in firsts and '{"city": "Paris", "days": 3' in firsts
    assert not any(a.startswith('{"city": "Paris", "days": ') and a[-1] == " " for a in firsts)
    named_at = text.index("<function=get_weather>") + len("<function=get_weather>")
    assert seen[named_at - 1] == [] and seen[named_at][0].name == "get_weather"  # no call before


def test_unbound_format_reads_values_as_text():
    scan = TOOL_CALL_FORMATS["glm45"].scan(
        "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", True
    )
    assert [(c.name, c.arguments) for c in scan.calls] == [("f", '{"n": "3"}')]


MALFORMED = {
    "qwen3_coder": [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis",  # cut mid-value
        "<tool_call>\n<function=get_weather\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
        "<tool_call>\n</tool_call>",
        "<tool_call>\n<function=nope>\n</function>\n</tool_call>",  # an unknown function
    ],
    "glm45": [
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>",
        "<tool_call>\n</tool_call>",
        '<tool_call>{"name": "get_weather"}</tool_call>',
    ],
    "minimax_m2": [
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris',
        "<minimax:tool_call>\n<invoke>\n</invoke>\n</minimax:tool_call>",
        '<minimax:tool_call>\n<invoke name="get_weather">\n</minimax:tool_call>',
        "<minimax:tool_call>\n</minimax:tool_call>",
    ],
}


@pytest.mark.parametrize("fmt, text", [(f, t) for f, texts in MALFORMED.items() for t in texts])
def test_malformed_calls_are_text(fmt, text):
    tool_plan = plan(fmt)
    assert tool_plan.calls_from("Hi. " + text) == ("Hi. " + text, [])
    content, calls = streamed(tool_plan, list("Hi. " + text))
    assert content == "Hi. " + text or calls  # what was sent of a call stays sent


@pytest.mark.parametrize("fmt, text", [(g[0], g[1]) for g in GOLDEN])
def test_any_cut_or_change_never_raises(fmt, text):
    bound = TOOL_CALL_FORMATS[fmt].bind(FUNCTIONS)
    rng = random.Random(7)
    for n in range(len(text) + 1):
        bound.scan(text[:n], final=False)
        bound.scan(text[:n], final=True)
    for _ in range(200):
        i = rng.randrange(len(text))
        changed = text[:i] + rng.choice('<>/\n"=x') + text[i + rng.randint(0, 3) :]
        bound.scan(changed, final=True)
        plan(fmt).calls_from(changed)


# -- constraints --------------------------------------------------------------------------

ACCEPTED = {
    "qwen3_coder": [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n<parameter=unit>\nC\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{CODE}\n</parameter>\n"
        '<parameter=where>\n{"a":[1,true]}\n</parameter>\n</function>\n</tool_call>',
    ],
    "glm45": [
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
        "<arg_key>metric</arg_key>\n<arg_value>false</arg_value>\n</tool_call>\n"
        "<tool_call>get_time\n</tool_call>",
        f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{CODE}</arg_value>\n"
        '<arg_key>tags</arg_key>\n<arg_value>["x"]</arg_value>\n</tool_call>',
    ],
    "minimax_m2": [
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">New York'
        '</parameter>\n<parameter name="unit">F</parameter>\n</invoke>\n</minimax:tool_call>',
        '<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>',
    ],
}
REFUSED = {
    "qwen3_coder": [
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n"
        "</tool_call>",  # no city
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
        "<parameter=days>\ntwo\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nA</parameter>\n</parameter>\n"
        "</function>\n</tool_call>",  # the closing tag inside a value
    ],
    "glm45": [
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>A</arg_value>\n"
        "<arg_key>unit</arg_key>\n<arg_value>K</arg_value>\n</tool_call>",
        "<tool_call>other\n</tool_call>",
    ],
    "minimax_m2": [
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="days">1</parameter>'
        "\n</invoke>\n</minimax:tool_call>",
    ],
}


@pytest.mark.parametrize("fmt", NAMES)
def test_required_constraint_accepts_calls_that_parse_back(fmt):
    constraint = TOOL_CALL_FORMATS[fmt].constraint(FUNCTIONS, False, True, Conversion())
    make_spec(regex=constraint["regex"])  # the decoder compiles it
    pattern = re.compile(constraint["regex"], re.DOTALL)
    required = plan(fmt, "required")
    assert required.constraint == constraint
    for text in ACCEPTED[fmt]:
        assert pattern.fullmatch(text), text
        content, calls = required.calls_from(text)
        assert (
            content is None
            and calls
            and {n for n, _ in named(calls)} <= {"get_weather", "get_time"}
        )
    for text in REFUSED[fmt]:
        assert not pattern.fullmatch(text), text


@pytest.mark.parametrize("fmt", NAMES)
def test_named_constraint_is_one_call_of_that_function(fmt):
    close = TOOL_CALL_FORMATS[fmt].close_tag
    first = ACCEPTED[fmt][0]
    one = first[: first.index(close) + len(close)]
    named_regex = TOOL_CALL_FORMATS[fmt].constraint(FUNCTIONS[:1], True, True, Conversion())
    parallel = TOOL_CALL_FORMATS[fmt].constraint(FUNCTIONS, False, True, Conversion())
    assert re.fullmatch(named_regex["regex"], one, re.DOTALL)
    assert not re.fullmatch(named_regex["regex"], one + "\n" + one, re.DOTALL)
    assert re.fullmatch(parallel["regex"], one + "\n" + one, re.DOTALL)
    assert named(plan(fmt).calls_from(one)[1])[0][0] == "get_weather"


def test_constraint_written_values_parse_to_their_types():
    """What the constraint lets the decoder write reads back as the schema's types."""
    text = ACCEPTED["qwen3_coder"][0]
    assert named(plan("qwen3_coder", "required").calls_from(text)[1]) == [
        ("get_weather", {"city": "New York", "days": 2, "unit": "C"}),
        ("get_time", {}),
    ]


def test_function_without_declared_properties_takes_any_text_arguments():
    loose = [{"name": "run", "parameters": {"type": "object"}}]
    for fmt, text in {
        "qwen3_coder": "<tool_call>\n<function=run>\n<parameter=cmd>\nls -l\n</parameter>\n"
        "</function>\n</tool_call>",
        "glm45": "<tool_call>run\n<arg_key>cmd</arg_key>\n<arg_value>ls -l</arg_value>\n</tool_call>",
        "minimax_m2": '<minimax:tool_call>\n<invoke name="run">\n<parameter name="cmd">ls -l'
        "</parameter>\n</invoke>\n</minimax:tool_call>",
    }.items():
        constraint = TOOL_CALL_FORMATS[fmt].constraint(loose, True, False, Conversion())
        assert re.fullmatch(constraint["regex"], text, re.DOTALL), fmt
        scan = TOOL_CALL_FORMATS[fmt].bind(loose).scan(text, True)
        assert [(c.name, json.loads(c.arguments)) for c in scan.calls] == [
            ("run", {"cmd": "ls -l"})
        ]


@pytest.mark.parametrize("fmt", NAMES)
def test_strict_auto_structural_tag_compiles(fmt):
    from spruce.constrained.backends.structural_tag import structural_tag_to_lark

    loose = {"name": "run", "parameters": {"type": "object"}}
    for functions in (FUNCTIONS, [*FUNCTIONS, loose]):
        tag = TOOL_CALL_FORMATS[fmt].structural_tag(functions, parallel=True)
        assert tag["format"]["triggers"] == [TOOL_CALL_FORMATS[fmt].open_tag]
        assert "start:" in structural_tag_to_lark(tag)
