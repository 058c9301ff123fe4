# ruff: noqa: RUF002
# (the DeepSeek markers in the list are spelled with full-width bars and U+2581)
"""Tool-call formats: how a model family writes its calls, read from whole or streamed
output (`scan`), and the constraint that makes the decoder write them (`constraint`, for
tool_choice "required" or a named function; `structural_tag`, for tool_choice "auto" with
`"strict": true` functions: free text, and calls held to their exact schemas).

Every format scans text into the content around the calls and the calls so far
(`PartialCall`: the name once it is whole, the arguments' JSON text so far). A scan of text
that is still arriving only shows what cannot change: each part only grows as text is
added, so a stream sends the difference (`tool_stream.ToolCallStream`).

Formats (`TOOL_CALL_FORMATS`, the server's --tool-call-parser):
  hermes       Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  llama3_json  Llama 3.1+: `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or
               not), several separated by `;`
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
  pythonic     Llama 3.2+ / 4 style: `[f(a=1), g(b="x")]`, values as Python or JSON literals
  json         the fallback for templates that do not render tools: Hermes blocks, or the
               whole output a JSON call object or array (constrained: a JSON array of calls)
  qwen3_coder  Qwen3-Coder: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n
               </parameter>...</function>\n</tool_call>` (tool_formats_xml, as the next two)
  glm45        GLM-4.5 / 4.6 / 4.7: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V
               </arg_value>...</tool_call>`
  minimax_m2   MiniMax-M2: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="K">V
               </parameter>...</invoke>\n</minimax:tool_call>`
  deepseek_v3  DeepSeek-V3 / V3-0324: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
               <｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`
               (tool_formats_special, as the next two)
  deepseek_v31 DeepSeek-V3.1 / V3.2: `...<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
               <｜tool▁call▁end｜>...`
  kimi_k2      Kimi-K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
               <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`

The XML-like formats read raw argument values by the request's
function schemas (`ToolCallFormat.bind`). `--tool-call-parser-plugin module:Class` adds a
format of one's own (`register_plugin`); `auto` picks the format whose markers the chat
template writes, the most specific where several match.
"""

from __future__ import annotations

import ast
import importlib
import json
from typing import Any, ClassVar

from spruce.constrained.convert import Conversion
from spruce.constrained.core.patterns import escape_literal
from spruce.runtime.server.openai.json_prefix import skip_space
from spruce.runtime.server.openai.tool_format_base import (
    PLAIN_TEXT,
    PartialCall,
    Resume,
    Scan,
    ToolCallFormat,
    after_block,
    any_call_schema,
    call_schema,
    json_calls,
    repeated,
    required_schema,
    text_until,
)
from spruce.runtime.server.openai.tool_format_harmony import HarmonyToolFormat
from spruce.runtime.server.openai.tool_formats_special import (
    DeepSeekV3Format,
    DeepSeekV31Format,
    KimiK2Format,
)
from spruce.runtime.server.openai.tool_formats_xml import (
    Glm45Format,
    MiniMaxM2Format,
    Qwen3CoderFormat,
)
from spruce.runtime.server.openai.tool_tags import (
    call_tags,
    calls_list,
    calls_or_text,
    structural,
)

# Read by the other modules from here (the formats' common part lives in tool_format_base).
__all__ = ["TOOL_CALL_FORMATS", "PartialCall", "Scan", "ToolCallFormat", "required_schema",
           "tool_call_format", "detect_tool_call_format", "register_plugin"]  # fmt: skip


class HermesFormat(ToolCallFormat):
    name = "hermes"
    markers = ("<tool_call>",)
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    instructions = (
        "For each call, return a JSON object with the function name and arguments within "
        "<tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(self.open_tag)
        if first < 0:
            return Scan(text) if final else text_until(text, self.open_tag)
        scan = Scan(text[:first], resume=Resume(first))
        outside = [text[:first]]
        i = first
        while i >= 0:
            body_start = i + len(self.open_tag)
            close = text.find(self.close_tag, body_start)
            body = text[body_start : len(text) if close < 0 else close]
            found = json_calls(body, 0, final or close >= 0)
            scan.calls += found.calls
            scan.broken = scan.broken or found.broken or (final and not found.calls)
            if close < 0:
                break
            after = close + len(self.close_tag)
            i = text.find(self.open_tag, after)
            scan.resume = after_block(text, after, i, self.open_tag, len(scan.calls))
            outside.append(text[after : len(text) if i < 0 else i])
        if final:
            scan.content = "".join(outside).strip()
        return scan

    def constraint(
        self, calls: list[dict], single: bool, parallel: bool, conversion: Conversion
    ) -> dict[str, Any]:
        call = conversion.schema_regex(any_call_schema(calls))
        block = f"{escape_literal(self.open_tag)}\n{call}\n{escape_literal(self.close_tag)}"
        return {"regex": repeated(block, "\n", parallel and not single)}

    def structural_tag(self, functions: list[dict], parallel: bool) -> dict[str, Any]:
        """Free text; `<tool_call>` starts a call block (exact), then free text again."""
        tags = call_tags(functions, self.open_tag + "\n", "\n" + self.close_tag, "arguments")
        return structural({"type": "triggered_tags", "triggers": [self.open_tag], "tags": tags,
                           "stop_after_first": not parallel})  # fmt: skip


HERMES_BLOCKS = HermesFormat()  # JsonFormat's reader once its output is text with blocks


class JsonFormat(HermesFormat):
    """auto + strict: the Hermes blocks its instructions ask for, in free text (the
    structural tag it inherits); an output that is a bare JSON call stays unconstrained
    text then, as the model was told to use the blocks."""

    name = "json"
    markers = ()

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_space(text, 0)
        if start < len(text) and text[start] == "[":
            return json_calls(text, start + 1, final, close="]")
        if start < len(text) and text[start] == "{":
            return json_calls(text, start, final)
        scan = super().scan(text, final)
        if start == len(text):
            scan.resume = None  # white space so far: a JSON call may follow
        elif scan.resume is not None:
            scan.resume.reader = HERMES_BLOCKS
        return scan

    def constraint(
        self, calls: list[dict], single: bool, parallel: bool, conversion: Conversion
    ) -> dict[str, Any]:
        if single:
            return {"json_schema": call_schema(calls[0])}
        return {"json_schema": required_schema(calls, parallel)}


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    markers = (
        "<|start_header_id|>",
        '"parameters"',
    )  # Llama 3.x: header tokens, calls with "parameters"
    instructions = (
        'To call functions, respond with {"name": <function-name>, "parameters": <args-json-object>} '
        'only, several separated by "; ".'
    )
    python_tag = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_space(text, 0)
        if text.startswith(self.python_tag, start):
            start = skip_space(text, start + len(self.python_tag))
        if not final and self.python_tag.startswith(text[start:]) and start < len(text):
            return Scan("")
        if start < len(text) and text[start] != "{":
            return Scan(text, resume=Resume(len(text), reader=PLAIN_TEXT))
        if start >= len(text):
            return Scan(text if final else "")
        return json_calls(text, start, final, separator=";")

    def constraint(
        self, calls: list[dict], single: bool, parallel: bool, conversion: Conversion
    ) -> dict[str, Any]:
        call = conversion.schema_regex(any_call_schema(calls, "parameters"))
        return {"regex": repeated(call, "; ", parallel and not single)}

    def structural_tag(self, functions: list[dict], parallel: bool) -> dict[str, Any]:
        """The calls have no marker inside text (`scan` reads an output that starts with `{`
        as calls, `<|python_tag|>` or not): auto + strict is either text that does not start
        with `{`, or the calls (exact), after `<|python_tag|>` or not."""
        calls = calls_list(call_tags(functions, "", "", "parameters"), "; ", parallel)
        return calls_or_text(calls, "{", self.python_tag)


class MistralFormat(ToolCallFormat):
    """`[TOOL_CALLS]` is a special token that a decode skipping special tokens drops: a
    bare JSON array of calls at the start of the output counts too. The regex constraints
    (required / named calls) never emit special tokens, so they are that bare array.
    auto + strict: text after which `[TOOL_CALLS]` could be dropped would hide the calls,
    so the output is either text that does not start with `[`, or the calls array (exact),
    after `[TOOL_CALLS]` (the special token where it is one) or not."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    instructions = (
        'To call functions, respond with [TOOL_CALLS][{"name": <function-name>, "arguments": '
        "<args-json-object>}, ...] only."
    )
    marker = "[TOOL_CALLS]"

    def scan(self, text: str, final: bool) -> Scan:
        found = text.find(self.marker)
        if found >= 0:
            return self.after_marker(text, found, final)
        array = skip_space(text, 0)
        if array < len(text) and text[array] == "[":
            return self.array(text, array, "", final)
        if final or array == len(text):
            return Scan(text)
        return text_until(text, self.marker, MISTRAL_IN_TEXT)

    def after_marker(self, text: str, found: int, final: bool) -> Scan:
        scan = self.array(text, skip_space(text, found + len(self.marker)), text[:found], final)
        scan.resume = Resume(found, reader=MISTRAL_IN_TEXT)  # the content is the text before
        return scan

    def array(self, text: str, array: int, content: str, final: bool) -> Scan:
        """The calls of the array at `array`, after `content`."""
        if array >= len(text):
            return Scan(content, broken=final)
        if text[array] != "[":
            return Scan(content, broken=True)
        scan = json_calls(text, array + 1, final, close="]")
        scan.content = content.strip() if final else content
        return scan

    def constraint(
        self, calls: list[dict], single: bool, parallel: bool, conversion: Conversion
    ) -> dict[str, Any]:
        schema = {"type": "array", "items": any_call_schema(calls), "minItems": 1}
        if single or not parallel:
            schema["maxItems"] = 1
        return {"regex": conversion.schema_regex(schema)}

    def structural_tag(self, functions: list[dict], parallel: bool) -> dict[str, Any]:
        calls = calls_list(call_tags(functions, "", "", "arguments"), ", ", parallel)
        array = {"type": "tag", "begin": "[", "content": calls, "end": "]"}
        return calls_or_text(array, "[", self.marker)


class MistralInText(MistralFormat):
    """Mistral's reader once its output is text: calls only after `[TOOL_CALLS]`."""

    def scan(self, text: str, final: bool) -> Scan:
        found = text.find(self.marker)
        if found < 0:
            return Scan(text) if final else text_until(text, self.marker)
        return self.after_marker(text, found, final)


MISTRAL_IN_TEXT = MistralInText()


class PythonicFormat(ToolCallFormat):
    """Calls are whole only once the list closes: they are sent then (arguments at once).
    auto + strict: `scan` reads an output that starts with `[` as the call list, so the
    output is either text that does not start with `[`, or the list (exact: each argument
    a JSON value of its property's schema, in declared order, as `constraint` writes it)."""

    name = "pythonic"
    markers = ("[func_name1(",)
    instructions = "To call functions, respond with [func_name1(arg1=value1, arg2=value2), func_name2(...)] only."
    literal_names: ClassVar[dict[str, Any]] = {"true": True, "false": False, "null": None}
    most_optional = 6  # the constraint spells out each subset of optional arguments

    def scan(self, text: str, final: bool) -> Scan:
        stripped = text.strip()
        if not stripped.startswith("["):
            resume = Resume(len(text), reader=PLAIN_TEXT) if stripped else None
            return Scan(text, resume=resume)
        if not final:
            return Scan("")
        calls = self._parse(stripped)
        return Scan(text, broken=True) if calls is None else Scan("", calls)

    def _parse(self, text: str) -> list[PartialCall] | None:
        """The calls; None when the text is not a list of calls whose arguments are JSON-like
        literals (an unhashable dict key, a set, a complex number, a huge integer, nesting
        past the parser's depth: whatever the model writes is "not a call", never an error)."""
        try:
            tree = ast.parse(text, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = [self._call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None
        return None if any(c is None for c in calls) else calls

    def _call(self, node: ast.AST) -> PartialCall | None:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {k.arg: self._value(k.value) for k in node.keywords}
        return PartialCall(
            node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False), True
        )

    def _value(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Name) and node.id in self.literal_names:
            return self.literal_names[node.id]
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self._value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self._value(k): self._value(v) for k, v in zip(node.keys, node.values)}
        return ast.literal_eval(node)

    def constraint(
        self, calls: list[dict], single: bool, parallel: bool, conversion: Conversion
    ) -> dict[str, Any]:
        call = "|".join(self._call_regex(f, conversion) for f in calls)
        return {"regex": r"\[" + repeated(f"(?:{call})", ", ", parallel and not single) + r"\]"}

    def _check_optional(self, function: dict[str, Any], properties: dict, required: set) -> None:
        if sum(1 for k in properties if k not in required) > self.most_optional:
            message = f"pythonic tool calls: {function['name']!r} has over {self.most_optional} optional arguments"
            raise ValueError(message + " (too many combinations to constrain)")

    def _call_regex(self, function: dict[str, Any], conversion: Conversion) -> str:
        """name(k=v, ...): JSON values by each property's schema, in declared order."""
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties") or {}
        required = set(parameters.get("required") or [])
        self._check_optional(function, properties, required)
        items = [
            (f"{k}=(?:{conversion.schema_regex(s)})", k in required) for k, s in properties.items()
        ]
        return (
            escape_literal(function["name"]) + r"\(" + _arguments_regex(items, first=True) + r"\)"
        )

    def structural_tag(self, functions: list[dict], parallel: bool) -> dict[str, Any]:
        tags = [self._call_tag(f) for f in functions]
        calls = {
            "type": "tag",
            "begin": "[",
            "content": calls_list(tags, ", ", parallel),
            "end": "]",
        }
        return calls_or_text(calls, "[")

    def _call_tag(self, function: dict[str, Any]) -> dict[str, Any]:
        """name(k=v, ...) as a tag: the arguments' formats in declared order."""
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties") or {}
        required = set(parameters.get("required") or [])
        self._check_optional(function, properties, required)
        items = [(k, s, k in required) for k, s in properties.items()]
        return {
            "type": "tag",
            "begin": function["name"] + "(",
            "content": _arguments_format(items, True),
            "end": ")",
        }


def _arguments_format(items: list[tuple[str, Any, bool]], first: bool) -> dict[str, Any]:
    """The structural-tag twin of `_arguments_regex`: each optional argument there or not."""
    if not items:
        return {"type": "const_string", "value": ""}
    (name, schema, required), rest = items[0], items[1:]
    key = {"type": "const_string", "value": ("" if first else ", ") + name + "="}
    value = {
        "type": "json_schema",
        "json_schema": schema if isinstance(schema, (dict, bool)) else {},
    }
    this = {"type": "sequence", "elements": [key, value, _arguments_format(rest, False)]}
    if required:
        return this
    return {"type": "or", "elements": [this, _arguments_format(rest, first)]}


def _arguments_regex(items: list[tuple[str, bool]], first: bool) -> str:
    if not items:
        return ""
    (item, required), rest = items[0], items[1:]
    this = ("" if first else ", ") + item + _arguments_regex(rest, first=False)
    if required:
        return this
    return f"(?:{this}|{_arguments_regex(rest, first)})"


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    fmt.name: fmt
    for fmt in (
        HermesFormat(),
        Llama3JsonFormat(),
        MistralFormat(),
        PythonicFormat(),
        JsonFormat(),
        Qwen3CoderFormat(),
        Glm45Format(),
        MiniMaxM2Format(),
        DeepSeekV3Format(),
        DeepSeekV31Format(),
        KimiK2Format(),
        HarmonyToolFormat(),
    )
}
AUTO = "auto"


def tool_call_format(name: str, chat_template: str | None) -> ToolCallFormat:
    """The format named by --tool-call-parser, or for "auto" the one whose markers the chat
    template writes (else "json"); an unknown name is a ValueError listing the known ones."""
    if name == AUTO:
        return detect_tool_call_format(chat_template)
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; known: {', '.join([AUTO, *TOOL_CALL_FORMATS])}"
        )
    return TOOL_CALL_FORMATS[name]


def detect_tool_call_format(chat_template: str | None) -> ToolCallFormat:
    """The format all of whose markers the template writes; of several, the one with the
    most markers (the more specific: Qwen3-Coder's and GLM's templates write Hermes's
    `<tool_call>` too, and `<function=` or `<arg_key>` besides); else "json"."""
    template = chat_template or ""
    found = [
        fmt
        for fmt in TOOL_CALL_FORMATS.values()
        if fmt.markers and all(m in template for m in fmt.markers)
    ]
    if not found:
        return TOOL_CALL_FORMATS["json"]
    return max(found, key=lambda fmt: len(fmt.markers))  # the first of the most specific


def register_plugin(spec: str) -> ToolCallFormat:
    """--tool-call-parser-plugin `module:Class`: imports the ToolCallFormat subclass and
    registers an instance under its `name` (replacing a built-in format of that name), so
    --tool-call-parser names it and "auto" detects it by its markers. A bad spec is a
    ValueError saying why."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"--tool-call-parser-plugin {spec!r}: expected module:Class")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--tool-call-parser-plugin {spec!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, ToolCallFormat)):
        raise ValueError(f"--tool-call-parser-plugin {spec!r} is not a ToolCallFormat subclass")
    fmt = cls()
    if not fmt.name or fmt.name == AUTO:
        raise ValueError(f"--tool-call-parser-plugin {spec!r}: the class needs a `name`")
    TOOL_CALL_FORMATS[fmt.name] = fmt
    return fmt
