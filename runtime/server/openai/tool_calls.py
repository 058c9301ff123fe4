"""Tool calls for the chat API: the JSON schema that makes the constrained decoder emit
them (`tool_choice` "required" or a named function), and the parser that finds them in
free text (`tool_choice` "auto"): Hermes / Qwen `<tool_call>{...}</tool_call>` blocks, or
the whole output being a JSON object / array of {"name", "arguments"}.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from spruce.runtime.text.stop import stop_prefix_len

TOOL_CALL_OPEN = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
ANY_OBJECT = {"type": "object"}


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """One call of `function`: {"name": <its name>, "arguments": <its parameters>}."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": function.get("parameters") or ANY_OBJECT,
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A non-empty array of calls of any of the functions (one call when not parallel)."""
    calls = [call_schema(f) for f in functions]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def from_constrained(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """The calls of a constrained output (one object or an array); None if it does not
    parse (e.g. the output was cut by max_tokens)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return _calls(data, names)


def parse_auto(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content without the calls or None, calls) of free text; no calls: (text, [])."""
    if TOOL_CALL_OPEN in text:
        calls = []
        for block in _BLOCK.findall(text):
            found = _calls(loads_json(block), names)
            if found is None:
                return text, []
            calls += found
        if calls:
            content = _BLOCK.sub("", text).strip()
            return content or None, calls
        return text, []
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        found = _calls(loads_json(stripped), names)
        if found:
            return None, found
    return text, []


def loads_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _calls(data: Any, names: set[str]) -> list[dict[str, Any]] | None:
    items = data if isinstance(data, list) else [data]
    calls = [_call(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls


def _call(item: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        if loads_json(arguments) is None:
            return None
    else:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": item["name"], "arguments": arguments},
    }


class AutoToolStream:
    """Streams content under tool_choice "auto" while holding back what may be a tool
    call: text from a `<tool_call>` on (or a possible start of one), and everything when
    the output starts with `{` or `[`. `finish()` parses the whole text."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.text = ""
        self.sent = 0
        self.holding = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        head = self.text.lstrip()
        if self.sent == 0 and not head:
            return ""
        if self.sent == 0 and head[:1] in ("{", "["):
            self.holding = True
            return ""
        found = self.text.find(TOOL_CALL_OPEN, self.sent)
        if found >= 0:
            self.holding = True
            limit = found
        else:
            limit = len(self.text) - stop_prefix_len(self.text, (TOOL_CALL_OPEN,))
        out = self.text[self.sent : limit]
        self.sent = max(self.sent, limit)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, calls)."""
        content, calls = parse_auto(self.text, self.names)
        rest = self.text[self.sent :]
        if not calls:
            return rest, []
        if self.sent == 0:
            return content or "", calls
        return _BLOCK.sub("", rest).strip(), calls


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """For chat templates that do not render `tools`: how to call them (Hermes format)."""
    specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are:\n"
        f"<tools>\n{specs}\n</tools>\n"
        "For each call, return a JSON object with the function name and arguments within "
        "<tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
