"""Whatever a model writes, the tool-call parsers answer "not a call" (a broken scan), never
raise: odd Python literals for the pythonic format, unreadable names for the JSON ones."""

from __future__ import annotations

import pytest

from spruce.runtime.server.openai.tool_parsers import (
    HermesFormat,
    JsonFormat,
    Llama3JsonFormat,
    MistralFormat,
    PythonicFormat,
)

HUGE = "1" * 5000


@pytest.mark.parametrize(
    "text",
    [
        "[f(x={[1]: 2})]",  # unhashable dict key
        "[f(x={(1, 2): 2})]",
        "[f(x={1j: 2})]",
        "[f(x=1j)]",
        "[f(x={1, 2})]",
        "[f(x=b'a')]",
        "[f(x=...)]",
        "[f(x=1e999)]",  # infinity is not JSON
        f"[f(x={HUGE})]",
        "[f(x=" + "-" * 100_000 + "1)]",
        "[f(**k)]",
    ],
)
def test_odd_pythonic_literals_are_not_calls(text):
    scan = PythonicFormat().scan(text, True)
    assert scan.broken and scan.calls == [] and scan.content == text


def test_plain_pythonic_calls_still_parse():
    scan = PythonicFormat().scan("[f(x=1, y=[true, {'a': None}])]", True)
    assert [(c.name, c.arguments) for c in scan.calls] == [
        ("f", '{"x": 1, "y": [true, {"a": null}]}')
    ]


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (JsonFormat, f'{{"name": {HUGE}}}'),
        (Llama3JsonFormat, f'{{"name": {HUGE}}}'),
        (HermesFormat, f'<tool_call>{{"name": {HUGE}}}</tool_call>'),
        (MistralFormat, f'[TOOL_CALLS][{{"name": {HUGE}}}]'),
    ],
)
def test_a_name_python_cannot_read_is_not_a_call(fmt, text):
    for final in (False, True):
        assert fmt().scan(text, final).calls == []
