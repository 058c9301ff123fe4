"""One chat choice's output, split while it streams: the reasoning block first
(`delta.reasoning_content`), then the answer, read for tool calls in the model's format
(`delta.tool_calls`, arguments piece by piece) around plain `delta.content`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spruce.runtime.server.openai.chat_prompt import ChatPrompt, ToolPlan
from spruce.runtime.server.openai.tool_stream import ToolCallStream
from spruce.runtime.text.reasoning import ReasoningStream


@dataclass(slots=True)
class Pieces:
    """What one step of a choice's stream adds."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def delta(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class AnswerStream:
    """`feed(text delta)` -> Pieces; `finish()` -> the Pieces still held back."""

    def __init__(self, prompt: ChatPrompt, tools: ToolPlan, separate_reasoning: bool) -> None:
        fmt = prompt.reasoning if separate_reasoning else None
        self.reasoning: ReasoningStream | None = (
            fmt.stream(prompt.thinking) if fmt is not None else None
        )
        self.tools: ToolCallStream | None = tools.stream()

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.has_calls and not self.tools.failed

    def feed(self, delta: str) -> Pieces:
        reasoning, content = (
            self.reasoning.feed(delta) if self.reasoning is not None else ("", delta)
        )
        return self._answer(reasoning, content)

    def finish(self) -> Pieces:
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        pieces = self._answer(reasoning, content)
        if self.tools is not None:
            rest, calls = self.tools.finish()
            pieces.content += rest
            pieces.tool_calls += calls
        return pieces

    def _answer(self, reasoning: str, content: str) -> Pieces:
        if self.tools is None:
            return Pieces(reasoning, content)
        content, calls = self.tools.feed(content)
        return Pieces(reasoning, content, calls)
