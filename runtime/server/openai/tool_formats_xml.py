"""Tool-call formats whose calls are XML-like tags with each argument's value as raw text:
Qwen3-Coder, GLM-4.5 / 4.6 / 4.7 and MiniMax-M2 (`tool_parsers` lists every format).

Their templates write a string argument bare and any other value as JSON, so a value is read
by its function's parameters schema (`bind`): a string property keeps the text, any other
type is parsed as JSON (or a Python literal such as `True`, which a template's `| string`
writes), falling back to the text. Unknown arguments stay strings. Arguments stream as the
JSON text of the object so far: a string value grows piece by piece, any other value comes
whole once its closing tag has arrived.

Constraints (`constraint`, `structural_tag`) write each declared argument in order, the
optional ones there or not: a string as any text without the closing tag (or one of its
`enum` / `const` values), any other value as JSON of its schema.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from spruce.constrained.convert import Conversion
from spruce.constrained.core.patterns import escape_literal
from spruce.runtime.server.openai.tool_format_base import (
    Block,
    BlockFormat,
    Cursor,
    PartialCall,
    repeated,
)
from spruce.runtime.server.openai.tool_tags import structural
from spruce.runtime.text.reasoning import text_without_regex
from spruce.runtime.text.stop import stop_prefix_len

PYTHON_LITERALS = {"True": True, "False": False, "None": None}
ANY_KEY = '[^<>\n"]+'  # an argument name where the function declares none


def is_text(schema: Any) -> bool:
    """Whether a property's value is written as bare text: a string schema, or none."""
    if not isinstance(schema, dict):
        return schema is None
    kind = schema.get("type")
    if kind is None:
        return bool(text_values(schema))
    return kind == "string" or kind == ["string"]


def text_values(schema: dict) -> list[str] | None:
    """The values of a string `enum` / `const` (None when it has neither, or others)."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if not values or not all(isinstance(v, str) for v in values):
        return None
    return values


def typed_value(raw: str, schema: Any) -> Any:
    if is_text(schema):
        return raw
    text = raw.strip()
    if text in PYTHON_LITERALS:
        return PYTHON_LITERALS[text]
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # not JSON, or past Python's digit limit
        return raw


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class RawCall:
    """A call as read so far: its name, each argument's raw text (and whether it is whole)."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.values: list[tuple[str, str, bool]] = []
        self.complete = False

    def partial(self, properties: dict[str, Any]) -> PartialCall:
        """The call with its arguments as the JSON text of an object so far."""
        members = []
        for key, raw, whole in self.values:
            schema = properties.get(key)
            head = json.dumps(key, ensure_ascii=False) + ": "
            if whole:
                members.append(head + json.dumps(typed_value(raw, schema), ensure_ascii=False))
            elif is_text(schema):
                members.append(head + json.dumps(raw, ensure_ascii=False)[:-1])
        arguments = "{" + ", ".join(members) + ("}" if self.complete else "")
        return PartialCall(self.name, arguments if self.name is not None else "", self.complete)


class XmlFormat(BlockFormat):
    """A family's spelling: a block holds `call_begin(name)`, the arguments (each
    `argument_begin(key)`, its value, `argument_end`) and `call_end`. `trim_newline`: the
    template writes a newline either side of a value, which is not part of it."""

    value_close = ""  # the closing tag that ends a value
    argument_end = call_end = ""
    trim_newline = False

    def __init__(self) -> None:
        self.properties: dict[str, dict[str, Any]] = {}

    def bind(self, functions: list[dict]) -> XmlFormat:
        bound = copy.copy(self)
        bound.properties = {
            f["name"]: (f.get("parameters") or {}).get("properties") or {} for f in functions
        }
        return bound

    def call_begin(self, name: str) -> str:
        raise NotImplementedError

    def argument_begin(self, key: str) -> str:
        raise NotImplementedError

    def read_calls(self, cursor: Cursor) -> tuple[list[RawCall], bool | None]:
        """The calls of the block at the cursor (past `open_tag`), and True once the block
        is closed (the cursor past `close_tag`), None while it is arriving, False when it
        is not calls of the format."""
        raise NotImplementedError

    def read_block(self, text: str, start: int) -> Block:
        cursor = Cursor(text, start + len(self.open_tag))
        calls, closed = self.read_calls(cursor)
        partial = [c.partial(self.properties.get(c.name or "", {})) for c in calls]
        if closed is None:
            return partial, None, False
        return partial, cursor.i if closed else None, not closed or not calls

    def read_value(self, cursor: Cursor, call: RawCall, key: str) -> bool:
        """Reads a value up to `value_close` into the call; False while it is arriving (the
        text so far is shown, less a tail that may start the closing tag)."""
        raw = cursor.upto(self.value_close)
        whole = raw is not None
        if raw is None:
            raw = cursor.text[cursor.i :]
            stops = (
                (self.value_close, "\n" + self.value_close)
                if self.trim_newline
                else (self.value_close,)
            )
            raw = raw[: len(raw) - stop_prefix_len(raw, stops)]
        if self.trim_newline:
            raw = raw.removeprefix("\n")
            raw = raw.removesuffix("\n") if whole else raw
        call.values.append((key, raw, whole))
        return whole

    # -- constraints ---------------------------------------------------------------------

    def constraint(
        self, calls: list[dict], single: bool, parallel: bool, conversion: Conversion
    ) -> dict[str, Any]:
        call = "|".join(self._call_regex(f, conversion) for f in calls)
        return {"regex": repeated(f"(?:{call})", "\n", parallel and not single)}

    def _call_regex(self, function: dict[str, Any], conversion: Conversion) -> str:
        begin = escape_literal(self.open_tag + self.call_begin(function["name"]))
        items = []
        for key, schema, required in _declared(function):
            item = self._argument_regex(escape_literal(self.argument_begin(key)),
                                        self._value_regex(schema, conversion))  # fmt: skip
            items.append(item if required else f"(?:{item})?")
        if not items and not _declared_any(function):
            items = [f"(?:{self._argument_regex(self._any_key_regex(), self._text_regex())})*"]
        return begin + "".join(items) + escape_literal(self.call_end + self.close_tag)

    def _argument_regex(self, begin: str, value: str) -> str:
        return begin + f"(?:{value})" + escape_literal(self.argument_end)

    def _any_key_regex(self) -> str:
        begin = self.argument_begin("\0")
        head, tail = begin.split("\0")
        return escape_literal(head) + ANY_KEY + escape_literal(tail)

    def _text_regex(self) -> str:
        return text_without_regex(self.value_close)

    def _value_regex(self, schema: Any, conversion: Conversion) -> str:
        if is_text(schema):
            values = text_values(schema) if isinstance(schema, dict) else None
            if values:
                return "|".join(escape_literal(v) for v in values)
            return self._text_regex()
        return conversion.schema_regex(schema if isinstance(schema, (dict, bool)) else {})

    def structural_tag(self, functions: list[dict], parallel: bool) -> dict[str, Any]:
        """Free text; the block's opening tag starts a call of one of the functions."""
        tags = [
            {
                "type": "tag",
                "begin": self.open_tag + self.call_begin(f["name"]),
                "content": self._arguments_format(f),
                "end": self.call_end + self.close_tag,
            }
            for f in functions
        ]
        return structural({"type": "triggered_tags", "triggers": [self.open_tag], "tags": tags,
                           "stop_after_first": not parallel})  # fmt: skip

    def _arguments_format(self, function: dict[str, Any]) -> dict[str, Any]:
        empty = {"type": "const_string", "value": ""}
        elements = []
        for key, schema, required in _declared(function):
            item = self._argument_format(key, schema)
            elements.append(item if required else {"type": "or", "elements": [item, empty]})
        if not elements and not _declared_any(function):
            any_argument = self._argument_regex(self._any_key_regex(), self._text_regex())
            return {"type": "regex", "pattern": f"(?:{any_argument})*"}
        return {"type": "sequence", "elements": elements} if elements else empty

    def _argument_format(self, key: str, schema: Any) -> dict[str, Any]:
        """A text value runs (lazily) to the argument's end and never holds `value_close`;
        a JSON one is its schema's JSON."""
        begin, end = self.argument_begin(key), self.argument_end
        values = text_values(schema) if isinstance(schema, dict) else None
        if is_text(schema) and not values:
            text = {"type": "any_text", "excludes": [self.value_close]}
            return {"type": "tag", "begin": begin, "content": text, "end": end}
        if values:
            value = {"type": "regex", "pattern": "|".join(escape_literal(v) for v in values)}
        else:
            json_schema = schema if isinstance(schema, (dict, bool)) else {}
            value = {"type": "json_schema", "json_schema": json_schema}
        return {"type": "tag", "begin": begin, "content": value, "end": end}


def _declared(function: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """(name, schema, required) of each declared argument, in declared order."""
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required") or [])
    return [(k, s, k in required) for k, s in (parameters.get("properties") or {}).items()]


def _declared_any(function: dict[str, Any]) -> bool:
    """Whether the parameters schema declares its properties (even none)."""
    return "properties" in (function.get("parameters") or {})


class FunctionBlocks(XmlFormat):
    """Blocks of function elements, each of parameter elements (Qwen3-Coder, MiniMax-M2):
    `call_open NAME name_end` then `param_open KEY key_end VALUE value_close`..., up to
    `call_close` (`forgive_unclosed`: a missing `call_close` before the block's close tag
    is forgiven)."""

    call_open = name_end = call_close = param_open = key_end = ""
    forgive_unclosed = False

    def read_calls(self, cursor: Cursor) -> tuple[list[RawCall], bool | None]:
        calls: list[RawCall] = []
        while True:
            cursor.space()
            if cursor.take(self.close_tag):
                return calls, True
            if not cursor.take(self.call_open):
                return calls, _undecided(cursor, self.close_tag, self.call_open)
            name = cursor.upto(self.name_end)
            if name is None or not _plain_name(name):
                unfinished = name is None and "\n" not in cursor.text[cursor.i :]
                return calls, None if unfinished else False
            call = RawCall(name.strip())
            calls.append(call)
            done = self._parameters(cursor, call)
            if done is not True:
                return calls, done

    def _parameters(self, cursor: Cursor, call: RawCall) -> bool | None:
        while True:
            cursor.space()
            if cursor.take(self.call_close) or (
                self.forgive_unclosed and cursor.at(self.close_tag)
            ):
                call.complete = True
                return True
            if not cursor.take(self.param_open):
                return _undecided(cursor, self.call_close, self.param_open, self.close_tag)
            key = cursor.upto(self.key_end)
            if key is None or not self.read_value(cursor, call, key.strip()):
                return None


class Qwen3CoderFormat(FunctionBlocks):
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
    </function>\\n</tool_call>`; a block may hold several functions, and a missing
    `</function>` before `</tool_call>` is forgiven."""

    name = "qwen3_coder"
    markers = ("<tool_call>", "<function=")
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    value_close, argument_end, call_end = "</parameter>", "\n</parameter>\n", "</function>\n"
    call_open, name_end, call_close = "<function=", ">", "</function>"
    param_open, key_end = "<parameter=", ">"
    trim_newline = forgive_unclosed = True
    instructions = (
        "For each call, write:\n<tool_call>\n<function=example_function_name>\n"
        "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
    )

    def call_begin(self, name: str) -> str:
        return f"\n<function={name}>\n"

    def argument_begin(self, key: str) -> str:
        return f"<parameter={key}>\n"


class Glm45Format(XmlFormat):
    """`<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`,
    one call a block (GLM-4.7 writes no newlines)."""

    name = "glm45"
    markers = ("<tool_call>", "<arg_key>")
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    value_close, argument_end = "</arg_value>", "</arg_value>\n"
    instructions = (
        "For each call, write:\n<tool_call>function_name\n<arg_key>argument_name</arg_key>\n"
        "<arg_value>value</arg_value>\n</tool_call>"
    )

    def call_begin(self, name: str) -> str:
        return f"{name}\n"

    def argument_begin(self, key: str) -> str:
        return f"<arg_key>{key}</arg_key>\n<arg_value>"

    def read_calls(self, cursor: Cursor) -> tuple[list[RawCall], bool | None]:
        cursor.space()
        rest = cursor.text[cursor.i :]
        ends = [i for i in (rest.find("\n"), rest.find("<")) if i >= 0]
        if not ends:
            return [], None
        name = rest[: min(ends)].strip()
        if not _plain_name(name):
            return [], False
        call = RawCall(name)
        cursor.i += min(ends)
        while True:
            cursor.space()
            if cursor.take(self.close_tag):
                call.complete = True
                return [call], True
            if not cursor.take("<arg_key>"):
                return [call], _undecided(cursor, self.close_tag, "<arg_key>")
            key = cursor.upto("</arg_key>")
            if key is None:
                return [call], None
            cursor.space()
            if not cursor.take("<arg_value>"):
                return [call], _undecided(cursor, "<arg_value>")
            if not self.read_value(cursor, call, key.strip()):
                return [call], None


class MiniMaxM2Format(FunctionBlocks):
    """`<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>\\n...
    </invoke>\\n</minimax:tool_call>`; a block holds one or more invokes."""

    name = "minimax_m2"
    markers = ("<minimax:tool_call>",)
    open_tag, close_tag = "<minimax:tool_call>", "</minimax:tool_call>"
    value_close, argument_end, call_end = "</parameter>", "</parameter>\n", "</invoke>\n"
    call_open, name_end, call_close = '<invoke name="', '">', "</invoke>"
    param_open, key_end = '<parameter name="', '">'
    instructions = (
        'For each call, write:\n<minimax:tool_call>\n<invoke name="function_name">\n'
        '<parameter name="argument_name">value</parameter>\n</invoke>\n</minimax:tool_call>'
    )

    def call_begin(self, name: str) -> str:
        return f'\n<invoke name="{name}">\n'

    def argument_begin(self, key: str) -> str:
        return f'<parameter name="{key}">'


def _undecided(cursor: Cursor, *words: str) -> bool | None:
    """None while the text ends inside one of the words that may come next, else False."""
    return None if cursor.at_end or any(cursor.at(w) is None for w in words) else False


def _plain_name(name: str) -> bool:
    return bool(name.strip()) and not any(c in name for c in '<>"\n')
