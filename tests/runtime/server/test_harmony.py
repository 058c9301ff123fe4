"""gpt-oss's harmony output on the chat path (no model): golden transcripts read into
reasoning_content (the analysis channel), content (the final channel) and tool calls
(commentary messages to functions.*), whole and streamed alike; the constraint for
tool_choice "required" writes text that reads back as the call."""

from __future__ import annotations

import random
import re

import pytest

from spruce.constrained.spec import make_spec
from spruce.runtime.server.openai.chat_prompt import ChatPrompt, ToolPlan
from spruce.runtime.server.openai.chat_stream import AnswerStream
from spruce.runtime.server.openai.schemas import ChatRequest
from spruce.runtime.server.openai.tool_format_harmony import call_header
from spruce.runtime.server.openai.tool_parsers import TOOL_CALL_FORMATS, detect_tool_call_format
from spruce.runtime.text.reasoning import REASONING_FORMATS, detect_reasoning

HARMONY = REASONING_FORMATS["gpt-oss"]
TOOLS_FORMAT = TOOL_CALL_FORMATS["gpt-oss"]
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
FUNCTIONS = [{"name": "get_weather", "parameters": PARAMS}, {"name": "get_time"}]
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
USER = [{"role": "user", "content": "Weather in Paris?"}]
# As gpt-oss writes them after the template's `<|start|>assistant` (the end-of-turn token,
# <|return|> or <|call|>, is a stop token the runtime trims).
ANSWER = ("<|channel|>analysis<|message|>User asks about Paris weather. No tool needed; "
          "say it is mild.<|end|><|start|>assistant<|channel|>final<|message|>"
          "It is mild in Paris today.")  # fmt: skip
CALL = ("<|channel|>analysis<|message|>Need to use get_weather for Paris.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris","days":2}')  # fmt: skip
CALL_RECIPIENT_FIRST = ("<|channel|>analysis<|message|>Call it.<|end|>"
                        "<|start|>assistant to=functions.get_time<|channel|>commentary json"
                        "<|message|>{}")  # fmt: skip


def plan(choice: str = "auto") -> ToolPlan:
    req = ChatRequest(model="m", messages=USER, tools=TOOLS, tool_choice=choice)
    return ToolPlan.of(req, TOOLS_FORMAT)


def whole(prompt: ChatPrompt, tools: ToolPlan, text: str):
    reasoning, answer = prompt.split(text)
    content, calls = tools.calls_from(answer)
    return reasoning, content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def streamed(prompt: ChatPrompt, tools: ToolPlan, text: str, sizes):
    stream, pieces, i = AnswerStream(prompt, tools, True), [], 0
    for size in sizes:
        pieces.append(stream.feed(text[i : i + size]))
        i += size
    pieces.append(stream.finish())
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        for delta in piece.tool_calls:
            call = calls.setdefault(delta["index"], ["", ""])
            call[0] += delta["function"].get("name") or ""
            call[1] += delta["function"].get("arguments") or ""
    reasoning = "".join(p.reasoning for p in pieces)
    content = "".join(p.content for p in pieces)
    return reasoning or None, content or None, [tuple(c) for c in calls.values()]


def chunkings(text: str):
    yield [1] * len(text)
    rng = random.Random(7)
    for _ in range(10):
        sizes, left = [], len(text)
        while left:
            sizes.append(min(left, rng.randint(1, 12)))
            left -= sizes[-1]
        yield sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (ANSWER, ("User asks about Paris weather. No tool needed; say it is mild.",
                  "It is mild in Paris today.", [])),
        (CALL, ("Need to use get_weather for Paris.", None,
                [("get_weather", '{"city":"Paris","days":2}')])),
        (CALL_RECIPIENT_FIRST, ("Call it.", None, [("get_time", "{}")])),
    ],
)  # fmt: skip
def test_golden_transcripts_whole_and_streamed(text, expected):
    prompt, tools = ChatPrompt("", [], HARMONY, False), plan()
    assert whole(prompt, tools, text) == expected
    for sizes in chunkings(text):
        assert streamed(prompt, tools, text, sizes) == expected, sizes


def test_without_the_reasoning_parser_the_tool_format_skips_the_analysis():
    """--reasoning-parser none: the tool-call format alone reads the raw output."""
    prompt, tools = ChatPrompt("", [], None, False), plan()
    assert whole(prompt, tools, ANSWER) == (None, ANSWER, [])  # no calls: the text as it is
    assert whole(prompt, tools, CALL) == (
        None,
        None,
        [("get_weather", '{"city":"Paris","days":2}')],
    )
    scan = TOOLS_FORMAT.scan(ANSWER, final=True)
    assert scan.content == "It is mild in Paris today." and not scan.calls


@pytest.mark.parametrize(
    "text",
    [CALL.replace('{"city":"Paris","days":2}', '{"city": "Par'),  # cut short
     CALL.replace("functions.get_weather", "functions.unknown"),
     CALL.replace("functions.get_weather", "browser.search")],
)  # fmt: skip
def test_malformed_calls_read_as_text(text):
    prompt, tools = ChatPrompt("", [], HARMONY, False), plan()
    reasoning, content, calls = whole(prompt, tools, text)
    assert reasoning is not None and calls == [] and content.startswith("<|start|>assistant")


@pytest.mark.parametrize("inside", [False, True])
def test_required_constraint_writes_a_call_that_reads_back(inside):
    tools = plan("required")
    regex = tools.constraint["regex"]
    make_spec(regex=regex)  # the constrained decoder takes it
    wrapped = HARMONY.for_calls().constraint_regex(regex, inside)
    make_spec(regex=wrapped)
    call = call_header("get_weather") + '{"city":"Oslo"}'
    thought = "Use the tool.<|end|><|start|>assistant"
    text = (thought if inside else "<|channel|>analysis<|message|>" + thought) + call
    assert re.fullmatch(wrapped, text, re.DOTALL)
    assert re.fullmatch(wrapped, call, re.DOTALL) or inside  # thinking is optional outside
    assert not re.fullmatch(wrapped, text.replace("Oslo", "x" * 13), re.DOTALL)
    prompt = ChatPrompt("", [], HARMONY.for_calls(), inside)
    assert whole(prompt, tools, text) == (
        "Use the tool.",
        None,
        [("get_weather", '{"city":"Oslo"}')],
    )
    # the thinking budget's end marker is what the wrapped constraint expects next
    close = prompt.reasoning.budget_fields(4, inside, None)["thinking_close"]
    assert text.index(close) + len(close) == text.index(call)


def test_named_call_is_that_function():
    req = ChatRequest(model="m", messages=USER, tools=TOOLS,
                      tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
    regex = ToolPlan.of(req, TOOLS_FORMAT).constraint["regex"]
    assert re.fullmatch(regex, call_header("get_time") + "{}", re.DOTALL)
    assert not re.fullmatch(regex, call_header("get_weather") + '{"city":"A"}', re.DOTALL)


def test_strict_auto_structural_tag_compiles():
    strict = [{**FUNCTIONS[0], "strict": True}]
    tag = TOOLS_FORMAT.structural_tag(strict, parallel=True)
    make_spec(structural_tag=tag)
    assert tag["format"]["triggers"] == ["<|channel|>commentary to=functions."]


def test_auto_finds_harmony_for_a_gpt_oss_template():
    template = ("{{- 'namespace functions {' }}{{- '<|start|>assistant to=functions.' + name + "
                "'<|channel|>commentary json<|message|>' + args + '<|call|>' }}"
                "{{- '<|start|>assistant<|channel|>analysis<|message|>' + thinking + '<|end|>' }}")  # fmt: skip
    assert detect_tool_call_format(template).name == "gpt-oss"
    assert detect_reasoning(template).name == "gpt-oss"
