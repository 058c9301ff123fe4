"""sl.gen(..., separate_reasoning=...): the variable gets the answer after the reasoning
block, `<name>_reasoning_content` the reasoning; the program text keeps the whole output."""

from __future__ import annotations

import pytest
from test_lang_fakes import FakeBackend

import spruce.lang as sl
from spruce.lang.errors import ProgramError, UnsupportedFeatureError


class ThinkingBackend(FakeBackend):
    """Answers every request with the same scripted output."""

    def __init__(self, output: str) -> None:
        super().__init__()
        self.output = output

    def _output(self, ids: list[int], params: dict) -> list[int]:
        return self.tokenizer.encode(self.output)


@sl.function
def ask(s, prompt: str, how):
    s += prompt
    s += sl.gen("answer", max_tokens=30, separate_reasoning=how)


@pytest.mark.parametrize("prompt, how, output, reasoning, answer", [
    ("Q: 2+2?\n", True, "<think>\nadd them\n</think>\n\n4", "add them", "4"),
    ("Q: 2+2?\n", "qwen3", "4", None, "4"),
    ("Q: 2+2?\n<think>\n", True, "add them</think> 4", "add them", "4"),  # opened in the prompt
    ("Q: 2+2?\n", "deepseek-r1", "add them\n</think>\n4", "add them", "4"),
    ("Q: 2+2?\n", False, "<think>x</think>4", None, "<think>x</think>4"),
])  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_separate_reasoning(prompt, how, output, reasoning, answer, stream):
    state = ask.run(prompt=prompt, how=how, backend=ThinkingBackend(output), stream=stream)
    if stream:
        list(state.text_iter())
    assert state["answer"] == answer
    if how:
        assert state["answer_reasoning_content"] == reasoning
    assert state.text() == prompt + output


def test_bad_separate_reasoning_values():
    with pytest.raises(ProgramError, match="qwen3, deepseek-r1"):
        sl.gen("a", separate_reasoning="o1")
    backend = ThinkingBackend("x")

    @sl.function
    def samples(s):
        s += "Q:" + sl.gen("a", n=2, separate_reasoning=True)

    state = samples.run(backend=backend)
    assert isinstance(state.error(), UnsupportedFeatureError) and "one by one" in str(state.error())
