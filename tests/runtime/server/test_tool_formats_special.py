"""The special-token tool-call formats (tool_formats_special: deepseek_v3, deepseek_v31,
kimi_k2), no model: each family's transcript as its chat template writes it parsed into calls
and content, whole and streamed (char by char, random chunks), malformed calls returned as
text, and the required / named constraints accepting calls that parse back to the call."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from test_tool_formats_xml import chunks, named, streamed

from spruce.constrained.convert import Conversion
from spruce.constrained.spec import make_spec
from spruce.runtime.server.openai.chat_prompt import ToolPlan
from spruce.runtime.server.openai.schemas import ChatRequest
from spruce.runtime.server.openai.tool_parsers import TOOL_CALL_FORMATS


def ds(word: str) -> str:
    """A DeepSeek marker: `calls_begin` -> <(full-width bar)tool(U+2581)calls(U+2581)begin...>."""
    return "<\uff5ctool\u2581" + word.replace("_", "\u2581") + "\uff5c>"


CALLS_BEGIN, CALLS_END = ds("calls_begin"), ds("calls_end")
CALL_BEGIN, CALL_END, SEP = ds("call_begin"), ds("call_end"), ds("sep")
KIMI = {
    w: f"<|{w}|>"
    for w in ("tool_calls_section_begin", "tool_calls_section_end", "tool_call_begin",
              "tool_call_argument_begin", "tool_call_end")
}  # fmt: skip

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
FUNCTIONS = [
    {"name": "get_weather", "parameters": PARAMS},
    {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
]
WEATHER = {"city": "Paris } <x>", "days": 3}
ARGS = json.dumps(WEATHER)


def v3_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v31_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


def kimi_call(name: str, arguments: str, index: int = 0) -> str:
    k = KIMI
    return f"{k['tool_call_begin']}functions.{name}:{index}{k['tool_call_argument_begin']}{arguments}{k['tool_call_end']}"  # fmt: skip


KIMI_BEGIN, KIMI_END = KIMI["tool_calls_section_begin"], KIMI["tool_calls_section_end"]
BOTH = [("get_weather", WEATHER), ("get_time", {})]

# (format, output as the family's template writes it, content, calls as (name, arguments))
GOLDEN = [
    ("deepseek_v3", f"Let me check.{CALLS_BEGIN}{v3_call('get_weather', ARGS)}\n{v3_call('get_time', '{}')}{CALLS_END}",
     "Let me check.", BOTH),
    ("deepseek_v3", f"{CALLS_BEGIN}{v3_call('get_weather', ARGS)}{CALLS_END}", None, BOTH[:1]),
    ("deepseek_v31", f"Let me check.{CALLS_BEGIN}{v31_call('get_weather', ARGS)}{v31_call('get_time', '{}')}{CALLS_END}",
     "Let me check.", BOTH),
    ("deepseek_v31", f"{CALLS_BEGIN}{v31_call('get_weather', ARGS)}{CALLS_END}\n\nDone.", "Done.", BOTH[:1]),
    ("kimi_k2", f"Let me check.{KIMI_BEGIN}{kimi_call('get_weather', ARGS)}{kimi_call('get_time', '{}', 1)}{KIMI_END}",
     "Let me check.", BOTH),
    ("kimi_k2", f"{KIMI_BEGIN}\n{kimi_call('get_weather', ARGS)}\n{KIMI_END}", None, BOTH[:1]),
]  # fmt: skip
NAMES = ("deepseek_v3", "deepseek_v31", "kimi_k2")
CALL = {"deepseek_v3": v3_call, "deepseek_v31": v31_call, "kimi_k2": kimi_call}
SECTION = {"deepseek_v3": (CALLS_BEGIN, CALLS_END), "deepseek_v31": (CALLS_BEGIN, CALLS_END),
           "kimi_k2": (KIMI_BEGIN, KIMI_END)}  # fmt: skip


def plan(fmt: str, choice: str = "auto") -> ToolPlan:
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    req = ChatRequest(
        model="m", messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice=choice
    )
    return ToolPlan.of(req, TOOL_CALL_FORMATS[fmt])


@pytest.mark.parametrize("fmt, text, content, expected", GOLDEN)
def test_golden_transcripts_whole_and_streamed(fmt, text, content, expected):
    tool_plan = plan(fmt)
    got_content, calls = tool_plan.calls_from(text)
    assert got_content == content and named(calls) == expected
    for pieces in ([text], list(text), chunks(text, 1), chunks(text, 2)):
        streamed_content, streamed_calls = streamed(tool_plan, pieces)
        assert [(n, json.loads(a)) for n, a in streamed_calls] == expected
        assert streamed_content.strip() == (content or "")


@pytest.mark.parametrize("fmt", NAMES)
def test_arguments_stream_piece_by_piece(fmt):
    begin, _ = SECTION[fmt]
    text = begin + CALL[fmt]("get_weather", ARGS)
    seen = [TOOL_CALL_FORMATS[fmt].scan(text[:n], final=False).calls for n in range(len(text) + 1)]
    arguments = [calls[0].arguments for calls in seen if calls]
    assert all(b.startswith(a) for a, b in itertools.pairwise(arguments))
    assert arguments[-1] == ARGS and '{"city": "Par' in arguments
    assert all(calls[0].name == "get_weather" for calls in seen if calls)


@pytest.mark.parametrize("fmt", NAMES)
def test_section_marker_is_held_back_not_shown_as_content(fmt):
    begin, _ = SECTION[fmt]
    for n in range(1, len(begin)):
        assert TOOL_CALL_FORMATS[fmt].scan("Hi " + begin[:n], final=False).content == "Hi "
    assert TOOL_CALL_FORMATS[fmt].scan("Hi " + begin[:4], final=True).content == "Hi " + begin[:4]


MALFORMED = {
    "deepseek_v3": [
        f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": ',  # cut
        f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n{ARGS}{CALL_END}{CALLS_END}",  # no fence
        f"{CALLS_BEGIN}{CALLS_END}",
        f"{CALLS_BEGIN}{v3_call('get_weather', '[1, 2]')}{CALLS_END}",  # not an object
    ],
    "deepseek_v31": [
        f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city"',
        f"{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}not json{CALL_END}{CALLS_END}",
        f"{CALLS_BEGIN}{v31_call('nope', '{}')}{CALLS_END}",  # an unknown function
        f"{CALLS_BEGIN}{v31_call('get_weather', ARGS)}",  # the section never closes
    ],
    "kimi_k2": [
        f"{KIMI_BEGIN}{KIMI['tool_call_begin']}get_weather{KIMI['tool_call_argument_begin']}{{}}"
        f"{KIMI['tool_call_end']}{KIMI_END}",  # no functions.NAME:IDX id
        f"{KIMI_BEGIN}{kimi_call('get_weather', ARGS)}",
        f"{KIMI_BEGIN}garbage{KIMI_END}",
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
    rng = random.Random(11)
    for n in range(len(text) + 1):
        TOOL_CALL_FORMATS[fmt].scan(text[:n], final=False)
        TOOL_CALL_FORMATS[fmt].scan(text[:n], final=True)
    for _ in range(200):
        i = rng.randrange(len(text))
        changed = text[:i] + rng.choice('{}"\n:<|x') + text[i + rng.randint(0, 3) :]
        plan(fmt).calls_from(changed)


@pytest.mark.parametrize("fmt", NAMES)
def test_required_constraint_accepts_calls_that_parse_back(fmt):
    constraint = TOOL_CALL_FORMATS[fmt].constraint(FUNCTIONS, False, True, Conversion())
    make_spec(regex=constraint["regex"])
    pattern = re.compile(constraint["regex"], re.DOTALL)
    assert plan(fmt, "required").constraint == constraint
    begin, end = SECTION[fmt]
    between = "\n" if fmt == "deepseek_v3" else ""
    one = CALL[fmt]("get_weather", '{"city":"Oslo","days":2}')
    two = CALL[fmt]("get_time", "{}")
    for text, expected in [
        (begin + one + end, [("get_weather", {"city": "Oslo", "days": 2})]),
        (begin + one + between + two + end, [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]),
    ]:  # fmt: skip
        assert pattern.fullmatch(text), text
        content, calls = plan(fmt, "required").calls_from(text)
        assert content is None and named(calls) == expected
    for text in [
        begin + CALL[fmt]("get_weather", '{"days":2}') + end,  # no city
        begin + CALL[fmt]("other", "{}") + end,
        begin + end,
        one,  # no section
    ]:
        assert not pattern.fullmatch(text), text


@pytest.mark.parametrize("fmt", NAMES)
def test_named_constraint_is_one_call(fmt):
    constraint = TOOL_CALL_FORMATS[fmt].constraint(FUNCTIONS[:1], True, True, Conversion())
    begin, end = SECTION[fmt]
    one = CALL[fmt]("get_weather", '{"city":"A"}')
    between = "\n" if fmt == "deepseek_v3" else ""
    assert re.fullmatch(constraint["regex"], begin + one + end, re.DOTALL)
    assert not re.fullmatch(constraint["regex"], begin + one + between + one + end, re.DOTALL)


def test_kimi_call_ids_may_count_up_in_a_constraint():
    constraint = TOOL_CALL_FORMATS["kimi_k2"].constraint(FUNCTIONS, False, True, Conversion())
    text = KIMI_BEGIN + kimi_call("get_time", "{}", 0) + kimi_call("get_time", "{}", 1) + KIMI_END
    assert re.fullmatch(constraint["regex"], text, re.DOTALL)


@pytest.mark.parametrize("fmt", NAMES)
def test_formats_keep_special_tokens(fmt):
    """The markers are special tokens: the output must be read with them kept."""
    assert TOOL_CALL_FORMATS[fmt].special_tokens
    assert not TOOL_CALL_FORMATS["hermes"].special_tokens
