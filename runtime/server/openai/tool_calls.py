"""Tool calls in the chat prompt: the system prompt that teaches them to a model whose chat
template does not render `tools` (in the server's tool-call format), and the arguments of
earlier calls read back for the template. The formats themselves are
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


def tools_system_prompt(tools: list[dict[str, Any]], instructions: str) -> str:
    """For chat templates that do not render `tools`: the functions, and how to call them
    in the model's tool-call format (`instructions`, from its ToolCallFormat)."""
    specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are:\n"
        f"<tools>\n{specs}\n</tools>\n{instructions}"
    )
