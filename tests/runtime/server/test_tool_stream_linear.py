"""A tool-call stream scans from where its last scan said it may begin again (`Scan.resume`),
and a long call only once it grew by an eighth: the deltas of every format, in any
splitting, join into what the stream that scans the whole text on every delta sends (and the
calls into the whole output's), while the characters its scans read grow linearly with the
output (counted, not timed)."""

from __future__ import annotations

import json
import random

import pytest

from spruce.runtime.server.openai import tool_stream
from spruce.runtime.server.openai.tool_format_base import Scan, ToolCallFormat
from spruce.runtime.server.openai.tool_parsers import TOOL_CALL_FORMATS
from spruce.runtime.server.openai.tool_stream import ToolCallStream, final_calls

NAMES = {"get_weather", "get_time"}
FUNCTIONS = [{"name": n, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
             for n in sorted(NAMES)]  # fmt: skip
DS = {w: f"<\uff5ctool\u2581{w.replace('_', chr(0x2581))}\uff5c>" for w in ("calls_begin", "calls_end", "call_begin", "call_end", "sep")}  # fmt: skip


def call_text(fmt: str, name: str, city: str) -> str:
    """One call of `name` with {"city": city}, as format `fmt` writes it."""
    arguments = json.dumps({"city": city})
    if fmt in ("hermes", "json"):
        return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
    if fmt == "qwen3_coder":
        return f"<tool_call>\n<function={name}>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"
    if fmt == "glm45":
        return f"<tool_call>{name}\n<arg_key>city</arg_key>\n<arg_value>{city}</arg_value>\n</tool_call>"
    if fmt == "minimax_m2":
        return f'<minimax:tool_call>\n<invoke name="{name}">\n<parameter name="city">{city}</parameter>\n</invoke>\n</minimax:tool_call>'
    if fmt == "deepseek_v3":
        return f"{DS['calls_begin']}{DS['call_begin']}function{DS['sep']}{name}\n```json\n{arguments}\n```{DS['call_end']}{DS['calls_end']}"
    if fmt == "deepseek_v31":
        return f"{DS['calls_begin']}{DS['call_begin']}{name}{DS['sep']}{arguments}{DS['call_end']}{DS['calls_end']}"
    if fmt == "kimi_k2":
        return f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>{arguments}<|tool_call_end|><|tool_calls_section_end|>"
    if fmt == "gpt-oss":
        return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}"
    if fmt == "llama3_json":
        return f'{{"name": "{name}", "parameters": {arguments}}}'
    if fmt == "mistral":
        return f'[TOOL_CALLS][{{"name": "{name}", "arguments": {arguments}}}]'
    assert fmt == "pythonic"
    return f"[{name}(city={json.dumps(city)})]"


IN_TEXT = {"hermes", "json", "qwen3_coder", "glm45", "minimax_m2", "deepseek_v3", "deepseek_v31",
           "kimi_k2", "mistral", "gpt-oss"}  # fmt: skip  # calls may follow text
PROSE = "Sure, let me look: <tool and [TOOL and {curly} <|tool and <\uff5ctool here.\n"


def outputs(fmt: str) -> list[str]:
    one, two = call_text(fmt, "get_weather", "Oslo"), call_text(fmt, "get_time", "Lima")
    texts = [PROSE * 3, one, one[: len(one) * 2 // 3], call_text(fmt, "unknown", "x"),
             "  " + one, call_text(fmt, "get_weather", "x" * 6000)]  # fmt: skip
    if fmt in IN_TEXT:
        texts += [PROSE + one + PROSE, PROSE + one + "\n" + two + " done", PROSE + one[:-3]]
    if fmt == "gpt-oss":
        texts = [t.removeprefix("<|start|>assistant") for t in texts]
    return texts


def splittings(text: str) -> list[list[str]]:
    """Whole, one character at a time (short texts: the whole-text reference is quadratic),
    and three random splittings (at most 200 pieces)."""
    rng = random.Random(len(text))
    chunks = []
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 5, 199)))
        chunks.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return [[text], *([list(text)] if len(text) <= 1000 else []), *chunks]


class WholeText(ToolCallFormat):
    """The format, its scans without a resume point: the stream scans the whole text."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt

    def scan(self, text: str, final: bool) -> Scan:
        scan = self.fmt.scan(text, final)
        scan.resume = None
        return scan


def joined(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)] by index) the stream sends for the pieces."""
    out = [stream.feed(p) for p in pieces] + [stream.finish()]
    calls: dict[int, list[str]] = {}
    for delta in (d for _, deltas in out for d in deltas):
        call = calls.setdefault(delta["index"], ["", ""])
        call[0] += delta["function"].get("name", "")
        call[1] += delta["function"]["arguments"]
    return "".join(c for c, _ in out), [tuple(calls[i]) for i in sorted(calls)]


def whole_text_stream(fmt: ToolCallFormat, pieces: list[str], monkeypatch) -> tuple:
    """What the stream that scans the whole text on every delta sends for the pieces."""
    with monkeypatch.context() as patch:
        patch.setattr(tool_stream, "SCAN_EVERY_DELTA_CHARS", 10**9)
        return joined(ToolCallStream(WholeText(fmt), NAMES), pieces)


@pytest.mark.parametrize("name", sorted(TOOL_CALL_FORMATS))
def test_any_splitting_sends_what_the_whole_text_scan_sends(name, monkeypatch):
    fmt = TOOL_CALL_FORMATS[name].bind(FUNCTIONS)
    for text in outputs(name):
        _, calls = final_calls(fmt, text, NAMES)
        for pieces in splittings(text):
            expected = whole_text_stream(fmt, pieces, monkeypatch)
            assert joined(ToolCallStream(fmt, NAMES), pieces) == expected, (text, pieces[:5])
            if calls:  # and the calls are the whole output's
                assert expected[1] == [
                    (c["function"]["name"], c["function"]["arguments"]) for c in calls
                ]


def scanned(name: str, text: str, size: int = 4) -> int:
    stream = ToolCallStream(TOOL_CALL_FORMATS[name].bind(FUNCTIONS), NAMES)
    for i in range(0, len(text), size):
        stream.feed(text[i : i + size])
    stream.finish()
    return stream.scanned


def long_output(name: str, chars: int) -> str:
    """Text of `chars` characters with a few calls in it (or, where the calls are the whole
    output, text only)."""
    calls = [call_text(name, "get_weather", "Oslo")] * 3 if name in IN_TEXT else [""] * 3
    prose = (PROSE * (chars // len(PROSE) // 4 + 1))[: chars // 4]
    return "".join(prose + call for call in calls) + prose


@pytest.mark.parametrize("name", sorted(TOOL_CALL_FORMATS))
def test_scans_read_linearly_many_characters(name):
    """200k characters in deltas of 4: formats that say where to begin again read about
    each character once per scan phase (and the finish); where they do not (harmony, the
    text after mistral's array), a constant factor more. Twice the output, twice the reading."""
    small, large = long_output(name, 200_000), long_output(name, 400_000)
    factor = 40 if name in ("gpt-oss", "mistral") else 3  # harmony; text after mistral's array
    assert scanned(name, small) <= factor * len(small)
    assert scanned(name, large) <= 2.2 * scanned(name, small)


def test_a_long_call_is_read_linearly():
    """Inside one call of 200k characters, scans come once it grew by an eighth."""
    text = call_text("hermes", "get_weather", "x" * 200_000)
    small, large = (
        scanned("hermes", text),
        scanned("hermes", call_text("hermes", "get_weather", "x" * 400_000)),
    )
    assert small <= 20 * len(text) and large <= 2.2 * small
