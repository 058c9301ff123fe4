"""Structural tags of tool calls: what tool_choice "auto" with `"strict": true` functions
may write in a format (each ToolCallFormat.structural_tag builds its own from these)."""

from __future__ import annotations

import json
import re
from typing import Any

ANY_OBJECT = {"type": "object"}


def strict_auto_tag(fmt: Any, functions: list[dict], parallel: bool) -> dict[str, Any] | None:
    """{"structural_tag": ...} for tool_choice "auto" in `fmt` (a ToolCallFormat) when a
    function is `strict` (its arguments are held to its parameters; the other functions' to
    any JSON object); None when none is."""
    if not any(f.get("strict") for f in functions):
        return None
    exact = [f if f.get("strict") else {**f, "parameters": ANY_OBJECT} for f in functions]
    return {"structural_tag": fmt.structural_tag(exact, parallel)}


def call_tags(functions: list[dict], begin: str, end: str, arguments_key: str) -> list[dict]:
    """One tag per function: `begin{"name": "<name>", "<arguments_key>": ` <parameters> `}end`."""
    return [
        {
            "type": "tag",
            "begin": f'{begin}{{"name": {json.dumps(f["name"], ensure_ascii=False)}, "{arguments_key}": ',
            "content": {"type": "json_schema", "json_schema": f.get("parameters") or ANY_OBJECT},
            "end": "}" + end,
        }
        for f in functions
    ]


def calls_or_text(calls: dict, opening: str, marker: str | None = None) -> dict[str, Any]:
    """For formats whose calls have no marker inside free text (the whole output is the
    calls or is text): text that does not start with `opening` (after white space), or the
    calls, after `marker` or not."""
    text = {"type": "regex", "pattern": rf"\s*(?:[^\s{re.escape(opening)}][\s\S]*)?"}
    elements = [text, calls]
    if marker:
        elements.append(
            {"type": "sequence", "elements": [{"type": "const_string", "value": marker}, calls]}
        )
    return structural({"type": "or", "elements": elements})


def calls_list(tags: list[dict], separator: str, parallel: bool) -> dict[str, Any]:
    """One call (or, `parallel`, several separated by `separator`) of the tags."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
            "stop_after_first": not parallel}  # fmt: skip


def structural(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}
