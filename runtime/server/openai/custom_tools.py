"""OpenAI's custom tools on chat completions: a tool whose input is free text or text in a
grammar (`{"type": "grammar", "grammar": {"syntax": "lark" | "regex", "definition": ...}}`).

When tool_choice names one (`{"type": "custom", "custom": {"name": ...}}`), the whole answer
is the tool's input: constrained to its grammar (`custom_constraint`) and returned as one
call `{"type": "custom", "custom": {"name", "input"}}` (`custom_call`, `CustomCallStream`).
Custom tools are not shown to the chat template (templates render function tools), and
"auto" / "required" never produce custom calls.
"""

from __future__ import annotations

from typing import Any

from spruce.runtime.server.openai.tool_stream import new_call_id


def custom_constraint(tool: dict[str, Any]) -> dict[str, str] | None:
    """The constraint of a custom tool's input: {"lark": ...} or {"regex": ...}, None for text."""
    grammar = (tool.get("format") or {}).get("grammar")
    return None if grammar is None else {grammar["syntax"]: grammar["definition"]}


def custom_call(name: str, text: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "custom", "custom": {"name": name, "input": text}}


class CustomCallStream:
    """The answer streamed as one custom call's input: the first delta carries the index,
    id, type and name, the next ones pieces of the input (as ToolCallStream's shapes)."""

    failed = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.has_calls = False

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        if not delta and self.has_calls:
            return "", []
        if self.has_calls:
            return "", [{"index": 0, "custom": {"input": delta}}]
        self.has_calls = True
        return "", [{"index": 0, **custom_call(self.name, delta)}]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self.feed("") if not self.has_calls else ("", [])
