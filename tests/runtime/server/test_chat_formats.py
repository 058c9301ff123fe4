"""Reasoning and tool-call parsing (no model): a table of model outputs -> the expected
reasoning_content, content and tool_calls, whole, cut short and streamed piece by piece;
the constraint regexes each format gives the decoder, checked against outputs it must
accept and refuse."""

from __future__ import annotations

import json
import re

import pytest

from spruce.constrained.convert import Conversion
from spruce.constrained.spec import make_spec
from spruce.runtime.server.openai.chat_prompt import ChatPrompt, ToolPlan
from spruce.runtime.server.openai.chat_stream import AnswerStream
from spruce.runtime.server.openai.schemas import ChatRequest
from spruce.runtime.server.openai.tool_parsers import (
    TOOL_CALL_FORMATS,
    detect_tool_call_format,
    required_schema,
    tool_call_format,
)
from spruce.runtime.text.reasoning import (
    REASONING_FORMATS,
    detect_reasoning,
    reasoning_format,
    text_without_regex,
)

NAMES = {"get_weather", "get_time"}
WEATHER = {"city": "Paris", "when": {"day": "mon", "hours": [9, 17]}, "note": "a } and a ]"}


def calls(*pairs: tuple[str, dict]) -> list[tuple[str, dict]]:
    return list(pairs)


# (format, model output, expected content, expected calls as (name, arguments))
TOOL_TABLE = [
    ("hermes", "Just text.", "Just text.", []),
    ("hermes", "Cut mid-tag <tool_ca", "Cut mid-tag <tool_ca", []),
    ("mistral", "Cut mid-tag [TOOL_CA", "Cut mid-tag [TOOL_CA", []),
    ("llama3_json", "<|python_ta", "<|python_ta", []),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + "}\n</tool_call>",
        "Let me check.",
        calls(("get_weather", WEATHER)),
    ),
    (
        "hermes",
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        ),
        None,
        calls(("get_weather", {"city": "Oslo"}), ("get_time", {})),
    ),
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', None, calls(("get_time", {}))),
    (
        "hermes",
        'x <tool_call>{"name": "get_weather", "argu',
        'x <tool_call>{"name": "get_weather", "argu',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        [],
    ),
    (
        "json",
        '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
        None,
        calls(("get_time", {}), ("get_weather", {"city": "Rome"})),
    ),
    (
        "json",
        '{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}",
        None,
        calls(("get_weather", WEATHER)),
    ),
    ("json", '[{"name": "get_time", "argu', '[{"name": "get_time", "argu', []),
    (
        "json",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        None,
        calls(("get_time", {})),
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
        None,
        calls(("get_weather", WEATHER)),
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Lima"}}',
        None,
        calls(("get_time", {}), ("get_weather", {"city": "Lima"})),
    ),
    ("llama3_json", "The answer is {curly}.", "The answer is {curly}.", []),
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {"a": ',
        '{"name": "get_time", "parameters": {"a": ',
        [],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}]",
        "Sure.",
        calls(("get_weather", WEATHER)),
    ),
    (
        "mistral",
        '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Kyiv"}}]',
        None,
        calls(("get_time", {}), ("get_weather", {"city": "Kyiv"})),
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {}',
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {}',
        [],
    ),
    ("mistral", "[1, 2] are numbers", "[1, 2] are numbers", []),
    (
        "pythonic",
        '[get_weather(city="Paris", when={"day": "mon", "hours": [9, 17]}, note="a } and a ]"), get_time()]',
        None,
        calls(("get_weather", WEATHER), ("get_time", {})),
    ),
    (
        "pythonic",
        "[get_weather(city=None, hot=true, n=-1.5)]",
        None,
        calls(("get_weather", {"city": None, "hot": True, "n": -1.5})),
    ),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
    ("pythonic", "No calls here.", "No calls here.", []),
]


def _named(tool_calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def _plan(fmt: str, choice: str = "auto") -> ToolPlan:
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in sorted(NAMES)
    ]
    req = ChatRequest(
        model="m", messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice=choice
    )
    return ToolPlan.of(req, TOOL_CALL_FORMATS[fmt])


def _stream(plan: ToolPlan, prompt: ChatPrompt, pieces: list[str]) -> tuple[str, str, list[dict]]:
    """(reasoning, content, calls joined by index) of a streamed output."""
    answer = AnswerStream(prompt, plan, separate_reasoning=True)
    out = [answer.feed(p) for p in pieces] + [answer.finish()]
    reasoning = "".join(p.reasoning for p in out)
    content = "".join(p.content for p in out)
    joined: dict[int, dict] = {}
    for delta in (d for p in out for d in p.tool_calls):
        call = joined.setdefault(delta["index"], {"function": {"name": None, "arguments": ""}})
        if "id" in delta:
            assert (
                delta["id"].startswith("call_")
                and delta["type"] == "function"
                and call["function"]["name"] is None
            )
            call["function"]["name"] = delta["function"]["name"]
        call["function"]["arguments"] += delta["function"]["arguments"]
    return reasoning, content, [joined[i] for i in sorted(joined)]


NO_REASONING = ChatPrompt("", [], None, False)


@pytest.mark.parametrize("fmt, text, content, expected", TOOL_TABLE)
def test_tool_calls_whole_and_streamed(fmt, text, content, expected):
    plan = _plan(fmt)
    got_content, got_calls = plan.calls_from(text)
    assert got_content == content and _named(got_calls) == expected
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    for pieces in ([text], list(text), [text[i : i + 3] for i in range(0, len(text), 3)]):
        _, streamed, streamed_calls = _stream(plan, NO_REASONING, pieces)
        if expected:  # content before the calls streams as it comes (not stripped)
            assert _named(streamed_calls) == expected and (content or "") == streamed.strip()
        elif streamed_calls:  # cut mid-call: what was sent of it stays sent, the rest is dropped
            assert {c["function"]["name"] for c in streamed_calls} <= NAMES
            assert all(
                c["function"]["arguments"] in text for c in streamed_calls
            ) and text.startswith(streamed)
        else:
            assert streamed == text


def test_arguments_stream_piece_by_piece():
    plan = _plan("hermes")
    answer = AnswerStream(NO_REASONING, plan, separate_reasoning=True)
    text = (
        '<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}</tool_call>"
    )
    deltas = [d for ch in text for d in answer.feed(ch).tool_calls]
    assert (
        deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
        and deltas[0]["index"] == 0
    )
    assert len(deltas) > 10 and all(set(d) == {"index", "function"} for d in deltas[1:])
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == WEATHER
    assert answer.finish().tool_calls == [] and answer.made_calls


# (format, model output, output starts inside the block, reasoning_content, content)
REASONING_TABLE = [
    (
        "qwen3",
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        False,
        "Let me think.",
        "The answer is 4.",
    ),
    ("qwen3", "The answer is 4.", False, None, "The answer is 4."),
    ("qwen3", "<think>\nStill thinking about 2 < 3", False, "Still thinking about 2 < 3", ""),
    ("qwen3", "<think></think>Quick.", False, "", "Quick."),
    ("qwen3", "<thinking is not a tag", False, None, "<thinking is not a tag"),
    ("qwen3", "  <thi", False, None, "  <thi"),  # cut mid-tag
    ("qwen3", "<think>a</thi", False, "a</thi", ""),
    (
        "deepseek-r1",
        "Step 1: a </thin b.\n</think>\n\nDone.",
        False,
        "Step 1: a </thin b.",
        "Done.",
    ),
    ("deepseek-r1", "<think>Hm.</think>Done.", False, "Hm.", "Done."),
    ("deepseek-r1", "cut mid-reasoning </th", False, "cut mid-reasoning </th", ""),
    ("qwen3", "opened in the prompt.</think>Yes.", True, "opened in the prompt.", "Yes."),
]


@pytest.mark.parametrize("fmt, text, inside, reasoning, content", REASONING_TABLE)
def test_reasoning_whole_and_streamed(fmt, text, inside, reasoning, content):
    parser = REASONING_FORMATS[fmt]
    assert parser.split(text, inside) == (reasoning, content)
    prompt = ChatPrompt("", [], parser, inside)
    for pieces in ([text], list(text), [text[i : i + 4] for i in range(0, len(text), 4)]):
        assert _stream(_plan("hermes", "none"), prompt, pieces)[:2] == (reasoning or "", content)


def test_reasoning_then_tool_calls_streamed():
    prompt = ChatPrompt("", [], REASONING_FORMATS["qwen3"], False)
    text = '<think>Call it.</think>\n\nOK.\n<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    reasoning, content, streamed = _stream(_plan("hermes"), prompt, list(text))
    assert reasoning == "Call it." and content.strip() == "OK."
    assert _named(streamed) == [("get_time", {"tz": "UTC"})]


def test_prompt_decides_where_the_output_starts():
    qwen3, r1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek-r1"]
    assert qwen3.starts_inside("<|im_start|>assistant\n<think>\n")
    assert not qwen3.starts_inside(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )  # enable_thinking: false
    assert not qwen3.starts_inside("<|im_start|>assistant\n") and r1.starts_inside(
        "<｜Assistant｜>"  # noqa: RUF001 - DeepSeek's own fullwidth bars
    )
    assert qwen3.closed_in_prompt(
        "assistant\n<think>\n\n</think>\n\n"
    ) and not qwen3.closed_in_prompt("assistant\n")
    assert not r1.closed_in_prompt("</think>")


@pytest.mark.parametrize("word", ["</think>", "</tool_call>", "ab"])
def test_text_without_regex_is_exact(word):
    """Checked against every short string over the word's characters (and two others)."""
    import itertools

    pattern = re.compile(text_without_regex(word), re.DOTALL)
    alphabet = sorted(set(word))[:4] + ["x", "\n"]
    for n in range(7):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            assert bool(pattern.fullmatch(text)) == (word not in text), text
    assert pattern.fullmatch("long " + word[:-1] + " text " + word[:-1]) and not pattern.fullmatch(
        "a" + word + "b"
    )


def test_reasoning_constraint_allows_thinking_then_the_answer():
    answer = make_spec(
        json_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        backend="spruce",
    ).regex
    free = re.compile(REASONING_FORMATS["qwen3"].constraint_regex(answer, inside=False), re.DOTALL)
    assert free.fullmatch('<think>\nMaybe {"n": 1}? No </thin...\n</think>\n\n{"n":2}')
    assert free.fullmatch('{"n":2}')
    assert not free.fullmatch('<think>a</think>b</think>{"n":2}') and not free.fullmatch(
        "<think>x</think>\n\nhello"
    )
    inside = re.compile(
        REASONING_FORMATS["deepseek-r1"].constraint_regex(answer, inside=False), re.DOTALL
    )
    assert inside.fullmatch('thinking</think>\n{"n":3}') and not inside.fullmatch('{"n":3}')
    make_spec(regex=free.pattern)  # the constrained decoder accepts it


PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
FUNCTIONS = [
    {"name": "get_weather", "parameters": PARAMS},
    {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
]

# (format, outputs its required-calls constraint accepts, outputs it refuses)
CONSTRAINT_TABLE = [
    (
        "hermes",
        [
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>',
            '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome","days":2}}\n</tool_call>',
        ],
        [
            '{"name":"get_time","arguments":{}}',
            '<tool_call>\n{"name":"get_weather","arguments":{}}\n</tool_call>',
        ],
    ),
    (
        "llama3_json",
        [
            '{"name":"get_weather","parameters":{"city":"Oslo"}}',
            '{"name":"get_time","parameters":{}}; {"name":"get_time","parameters":{}}',
        ],
        ['{"name":"get_weather","arguments":{"city":"Oslo"}}'],
    ),
    (
        "mistral",
        [
            '[{"name":"get_weather","arguments":{"city":"Oslo"}}]',
            '[{"name":"get_time","arguments":{}},{"name":"get_time","arguments":{}}]',
        ],
        [
            '[TOOL_CALLS][{"name":"get_time","arguments":{}}]',
            "[]",
            '{"name":"get_time","arguments":{}}',
        ],
    ),
    (
        "pythonic",
        ['[get_weather(city="Oslo")]', '[get_weather(city="Oslo", days=3), get_time()]'],
        ["[get_weather(days=3)]", "get_time()", '[get_weather(city="Oslo", x=1)]'],
    ),
]


@pytest.mark.parametrize("fmt, accepted, refused", CONSTRAINT_TABLE)
def test_required_constraint_in_each_format(fmt, accepted, refused):
    constraint = TOOL_CALL_FORMATS[fmt].constraint(
        FUNCTIONS, single=False, parallel=True, conversion=Conversion()
    )
    pattern = re.compile(constraint["regex"], re.DOTALL)
    make_spec(regex=constraint["regex"])
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    req = ChatRequest(
        model="m", messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="required"
    )
    plan = ToolPlan.of(req, TOOL_CALL_FORMATS[fmt])
    for text in accepted:
        assert pattern.fullmatch(text), text
        content, found = final = plan.calls_from(text)
        assert content is None and found, final
    for text in refused:
        assert not pattern.fullmatch(text), text


def test_named_and_single_calls_are_one_call():
    for name, fmt in TOOL_CALL_FORMATS.items():
        constraint = fmt.constraint(
            FUNCTIONS[:1], single=True, parallel=True, conversion=Conversion()
        )
        if name == "json":
            assert constraint["json_schema"]["properties"]["name"] == {"const": "get_weather"}
            continue
        pattern = re.compile(constraint["regex"], re.DOTALL)
        one = {
            "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"A"}}\n</tool_call>',
            "llama3_json": '{"name":"get_weather","parameters":{"city":"A"}}',
            "mistral": '[{"name":"get_weather","arguments":{"city":"A"}}]',
            "pythonic": '[get_weather(city="A")]',
            **NEW_FORMAT_CALLS,
        }[name]
        assert pattern.fullmatch(one), name
    assert required_schema(FUNCTIONS, parallel=False)["maxItems"] == 1


# One call of get_weather(city="A") in each format of tool_formats_xml / tool_formats_special.
NEW_FORMAT_CALLS = {
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
        "</function>\n</tool_call>"
    ),
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>A</arg_value>\n</tool_call>",
    "minimax_m2": (
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">A</parameter>\n'
        "</invoke>\n</minimax:tool_call>"
    ),
    "deepseek_v3": (
        "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>function"
        '<\uff5ctool\u2581sep\uff5c>get_weather\n```json\n{"city":"A"}\n```'
        "<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>"
    ),
    "deepseek_v31": (
        "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>get_weather"
        '<\uff5ctool\u2581sep\uff5c>{"city":"A"}'
        "<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>"
    ),
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city":"A"}<|tool_call_end|><|tool_calls_section_end|>'
    ),
    "gpt-oss": (  # tool_format_harmony
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"A"}'
    ),
}
LLAMA31_MARKERS = '{{- "<|start_header_id|>" }} Respond in the format {"name": function name, "parameters": dictionary}'


def test_formats_from_chat_templates_and_names():
    assert detect_tool_call_format("{{ '<tool_call>' }}{{ tools }}").name == "hermes"
    assert detect_tool_call_format(LLAMA31_MARKERS).name == "llama3_json"
    assert detect_tool_call_format("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert detect_tool_call_format("[func_name1(params_name1=params_value1)]").name == "pythonic"
    assert detect_tool_call_format(None).name == "json"
    assert detect_reasoning("{{ '<think>\\n' + reasoning + '\\n</think>' }}").name == "qwen3"
    assert detect_reasoning("{{ messages }}") is None
    assert reasoning_format("none", "<think></think>") is None
    assert reasoning_format("deepseek-r1", None).starts_open
    with pytest.raises(ValueError, match="known: auto, none, qwen3, deepseek-r1"):
        reasoning_format("o1", None)
    with pytest.raises(
        ValueError, match="known: auto, hermes, llama3_json, mistral, pythonic, json"
    ):
        tool_call_format("xml", None)


def test_every_format_teaches_its_calls():
    """Templates that do not render tools get a system prompt in the server's format."""
    from spruce.runtime.server.openai.tool_calls import tools_system_prompt

    shown = {"hermes": "<tool_call>", "json": "<tool_call>", "llama3_json": '"parameters"'}
    shown |= {"mistral": "[TOOL_CALLS]", "pythonic": "func_name1(arg1=value1"}
    shown |= {name: fmt.open_tag for name, fmt in TOOL_CALL_FORMATS.items() if name not in shown}
    for name, fmt in TOOL_CALL_FORMATS.items():
        prompt = tools_system_prompt(
            [{"type": "function", "function": FUNCTIONS[0]}], fmt.instructions
        )
        assert '"name": "get_weather"' in prompt and shown[name] in fmt.instructions, name


def test_a_wrapped_schema_answer_is_reported():
    from spruce.runtime.core.sampling_params import SamplingParams
    from spruce.runtime.server.openai.chat_prompt import answer_report

    prompt = ChatPrompt("", [], REASONING_FORMATS["qwen3"], False)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "multipleOf": 2}},
        "required": ["n"],
    }
    spruce = Conversion(
        backend="spruce"
    )  # its regex is wrapped (llguidance's: a Lark grammar, test_grammar_api)
    sampling, spec = prompt.constrain(SamplingParams(json_schema=json.dumps(schema)), spruce)
    assert sampling.json_schema is None and sampling.regex.startswith("(?:<think>")
    text = '<think>even?</think>\n{"n":3}'
    report = answer_report(spec, prompt.split(text)[1])["json_schema"]
    assert report["valid"] is False and "multiple of 2" in report["error"]
    assert answer_report(spec, '{"n":4}')["json_schema"]["valid"] is True
    assert (
        NO_REASONING.constrain(sampling, Conversion()) == (sampling, None)
        and answer_report(None, "x") == {}
    )
