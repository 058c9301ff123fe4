# ruff: noqa: RUF001, RUF002
# (the DeepSeek markers are spelled with full-width bars and U+2581)
"""Tool-call formats spelled with special tokens, their arguments a JSON object: DeepSeek-V3
(and V3-0324), DeepSeek-V3.1 / V3.2 and Kimi-K2 (`tool_parsers` lists every format).

All calls of a turn sit in one section (`open_tag` ... `close_tag`), each call between its
own markers; a call's name is sent once its marker after it has arrived, its arguments
stream as the JSON text so far. The markers are special tokens of these vocabularies
(`special_tokens`): the output is read with them kept. Constraints write them as text,
which the parsers read the same way.
"""

from __future__ import annotations

from typing import Any

from spruce.constrained.convert import Conversion
from spruce.constrained.core.patterns import escape_literal
from spruce.runtime.server.openai.json_prefix import value_end
from spruce.runtime.server.openai.tool_format_base import (
    Block,
    BlockFormat,
    Cursor,
    PartialCall,
    repeated,
)
from spruce.runtime.server.openai.tool_tags import ANY_OBJECT, structural


class SpecialTokenFormat(BlockFormat):
    """A section of calls: each `call_open`, the head naming the function (`read_head`),
    the JSON arguments, `arguments_end`, `call_close`; `separator` between calls."""

    special_tokens = True
    call_open = call_close = ""
    arguments_end = ""
    separator = ""

    def read_head(self, cursor: Cursor) -> str | bool | None:
        """The function's name (the cursor past the head up to the arguments), None while
        it is arriving, False when it is not a head of the format."""
        raise NotImplementedError

    def head(self, name: str) -> str:
        """The text between `call_open` and the arguments, as a constraint writes it."""
        raise NotImplementedError

    def head_regex(self, name: str) -> str:
        return escape_literal(self.head(name))

    def read_block(self, text: str, start: int) -> Block:
        cursor = Cursor(text, start + len(self.open_tag))
        calls: list[PartialCall] = []
        while True:
            cursor.space()
            if cursor.take(self.close_tag):
                return calls, cursor.i, not calls or not calls[-1].complete
            if not cursor.take(self.call_open):
                waiting = cursor.at_end or any(
                    cursor.at(w) is None for w in (self.close_tag, self.call_open)
                )
                return calls, None, not waiting
            call, done = self._call(cursor)
            if call is not None:
                calls.append(call)
            if done is not True:
                return calls, None, done is False

    def _call(self, cursor: Cursor) -> tuple[PartialCall | None, bool | None]:
        """(the call so far, True once it is closed / None while arriving / False broken)."""
        name = self.read_head(cursor)
        if not isinstance(name, str):
            return None, name
        if not name.strip() or any(c in name for c in "<>\n"):
            return None, False
        cursor.space()
        start = cursor.i
        if cursor.at_end:
            return PartialCall(name.strip()), None
        end = value_end(cursor.text, start) if cursor.text[start] == "{" else -1
        if end == -1:
            return None, False
        if end is None:
            return PartialCall(name.strip(), cursor.text[start:].rstrip()), None
        cursor.i = end
        call = PartialCall(name.strip(), cursor.text[start:end])
        for word in (self.arguments_end, self.call_close):
            cursor.space()
            if not cursor.take(word.strip()):
                return call, None if cursor.at(word.strip()) is None or cursor.at_end else False
        call.complete = True
        return call, True

    def constraint(
        self, calls: list[dict], single: bool, parallel: bool, conversion: Conversion
    ) -> dict[str, Any]:
        """The section with one call (several when `parallel` and not `single`)."""
        call = "|".join(
            escape_literal(self.call_open)
            + self.head_regex(f["name"])
            + f"(?:{conversion.schema_regex(f.get('parameters') or ANY_OBJECT)})"
            + escape_literal(self.arguments_end + self.call_close)
            for f in calls
        )
        body = repeated(f"(?:{call})", escape_literal(self.separator), parallel and not single)
        return {"regex": escape_literal(self.open_tag) + body + escape_literal(self.close_tag)}

    def structural_tag(self, functions: list[dict], parallel: bool) -> dict[str, Any]:
        """Free text; the section's opening marker starts the calls (exact), then text."""
        tags = [
            {
                "type": "tag",
                "begin": self.call_open + self.head(f["name"]),
                "content": {
                    "type": "json_schema",
                    "json_schema": f.get("parameters") or ANY_OBJECT,
                },
                "end": self.arguments_end + self.call_close,
            }
            for f in functions
        ]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                 "at_least_one": True, "stop_after_first": not parallel}  # fmt: skip
        section = {"type": "tag", "begin": self.open_tag, "content": calls, "end": self.close_tag}
        return structural({"type": "triggered_tags", "triggers": [self.open_tag],
                           "tags": [section], "stop_after_first": not parallel})  # fmt: skip


class DeepSeekV3Format(SpecialTokenFormat):
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}
    \\n```<｜tool▁call▁end｜>` ... `<｜tool▁calls▁end｜>`, calls a newline apart."""

    name = "deepseek_v3"
    markers = ("<｜tool▁calls▁begin｜>", "```json")
    open_tag, close_tag = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_open, call_close = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    arguments_end, separator = "\n```", "\n"
    instructions = (
        "To call functions, write <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        "function_name\n```json\n{arguments}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )

    def head(self, name: str) -> str:
        return f"function<｜tool▁sep｜>{name}\n```json\n"

    def read_head(self, cursor: Cursor) -> str | bool | None:
        if cursor.upto("<｜tool▁sep｜>") is None:
            return False if "\n" in cursor.text[cursor.i :] else None
        name = cursor.upto("\n")
        if name is None:
            return None
        cursor.space()
        if not cursor.take("```json"):
            return None if cursor.at("```json") is None or cursor.at_end else False
        return name


class DeepSeekV31Format(SpecialTokenFormat):
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`
    ... `<｜tool▁calls▁end｜>` (V3.1, V3.2)."""

    name = "deepseek_v31"
    markers = ("<｜tool▁calls▁begin｜>",)
    open_tag, close_tag = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_open, call_close = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    instructions = (
        "To call functions, write <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function_name"
        "<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )

    def head(self, name: str) -> str:
        return f"{name}<｜tool▁sep｜>"

    def read_head(self, cursor: Cursor) -> str | bool | None:
        name = cursor.upto("<｜tool▁sep｜>")
        if name is None:
            return False if "\n" in cursor.text[cursor.i :] else None
        return name


class KimiK2Format(SpecialTokenFormat):
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{...}<|tool_call_end|>` ... `<|tool_calls_section_end|>`."""

    name = "kimi_k2"
    markers = ("<|tool_calls_section_begin|>",)
    open_tag, close_tag = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_open, call_close = "<|tool_call_begin|>", "<|tool_call_end|>"
    instructions = (
        "To call functions, write <|tool_calls_section_begin|><|tool_call_begin|>"
        "functions.function_name:0<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    )

    def head(self, name: str) -> str:
        return f"functions.{name}:0<|tool_call_argument_begin|>"

    def head_regex(self, name: str) -> str:
        return (
            escape_literal(f"functions.{name}:")
            + "[0-9]{1,4}"
            + escape_literal("<|tool_call_argument_begin|>")
        )

    def read_head(self, cursor: Cursor) -> str | bool | None:
        call_id = cursor.upto("<|tool_call_argument_begin|>")
        if call_id is None:
            return False if "\n" in cursor.text[cursor.i :] else None
        return call_id.strip().removeprefix("functions.").rpartition(":")[0] or False
