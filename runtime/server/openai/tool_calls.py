"""Tool calls in the chat prompt: the system prompt that teaches them to a model whose chat
template does not render `tools` (Hermes format, which the "json" tool-call format reads),
and the arguments of earlier calls read back for the template. The formats themselves are
in `tool_parsers`, streaming in `tool_stream`.
"""

from __future__ import annotations

import json
from typing import Any


def loads_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


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
