"""Tool calls out of a model's output in a given format (`tool_parsers`): whole
(`final_calls`) or streamed (`ToolCallStream`: content as it comes, each call's name once
whole, its arguments piece by piece as OpenAI's `delta.tool_calls`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from spruce.runtime.server.openai.tool_parsers import PartialCall, Scan, ToolCallFormat


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_arguments(call: PartialCall) -> str | None:
    """The arguments as the JSON text of an object (a JSON string holding one is unwrapped),
    or None when they are not one."""
    try:
        value = json.loads(call.arguments)
        if isinstance(value, str):
            value, text = json.loads(value), value
        else:
            text = call.arguments
    except ValueError:
        return None
    return text if isinstance(value, dict) else None


def valid_calls(scan: Scan, names: set[str]) -> bool:
    if scan.broken or not scan.calls:
        return False
    return all(c.complete and c.name in names and call_arguments(c) is not None for c in scan.calls)


def final_calls(
    fmt: ToolCallFormat, text: str, names: set[str]
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content or None, calls) of a finished output; no valid calls: (text, [])."""
    scan = fmt.scan(text, final=True)
    if not valid_calls(scan, names):
        return text, []
    calls = [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": call_arguments(c)}}
             for c in scan.calls]  # fmt: skip
    return scan.content or None, calls


class ToolCallStream:
    """`feed(delta)` -> (content delta, tool-call deltas); `finish()` the same for what is
    left. A call's first delta carries its index, id, type and name; the next ones pieces
    of its arguments. A call to an unknown function, or output that turns out not to be
    calls, ends in content: everything not yet sent."""

    def __init__(self, fmt: ToolCallFormat, names: set[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.text = ""
        self.sent_content = 0
        self.sent_arguments: list[int] = []  # per call started
        self.failed = False

    @property
    def has_calls(self) -> bool:
        return bool(self.sent_arguments)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        if self.failed:
            return "", []
        scan = self.fmt.scan(self.text, final=False)
        return self._content(scan.content), self._call_deltas(scan.calls)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        scan = self.fmt.scan(self.text, final=True)
        if self.failed or not valid_calls(scan, self.names):
            self.failed = True  # e.g. cut by max_tokens: what was sent of a call stays sent
            rest = self.text[self.sent_content :] if not self.has_calls else ""
            return rest, []
        return self._content(scan.content), self._call_deltas(scan.calls)

    def _content(self, content: str) -> str:
        if self.has_calls and not content.startswith(self.text[: self.sent_content]):
            return ""  # final content was tidied (stripped): what was sent stays
        out = content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(content))
        return out

    def _call_deltas(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        out = []
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if call.name not in self.names:
                self.failed = True
                break
            out += self._deltas_of(index, call)
        return out

    def _deltas_of(self, index: int, call: PartialCall) -> list[dict[str, Any]]:
        if index == len(self.sent_arguments):
            self.sent_arguments.append(len(call.arguments))
            head = {"index": index, "id": new_call_id(), "type": "function"}
            return [{**head, "function": {"name": call.name, "arguments": call.arguments}}]
        piece = call.arguments[self.sent_arguments[index] :]
        self.sent_arguments[index] = len(call.arguments)
        return [{"index": index, "function": {"arguments": piece}}] if piece else []
