"""What every tool-call format shares (`tool_parsers` lists the formats): the scan of an
output into content and calls that only grow as text arrives (`Scan`, `PartialCall`), where
a scan of the text grown may begin again (`Resume`: a stream scans from there, so its work
is linear in the output), the format's interface (`ToolCallFormat`) and the JSON call
objects several formats write."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from spruce.constrained.convert import Conversion
from spruce.runtime.server.openai.json_prefix import object_members, skip_space
from spruce.runtime.server.openai.tool_tags import ANY_OBJECT
from spruce.runtime.text.stop import stop_prefix_len

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class PartialCall:
    """A call as far as it is known: `name` None until whole; `arguments` the JSON text of
    the arguments so far (a prefix of the final text); `complete` once the call is closed."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass(slots=True)
class Resume:
    """Where the scan of this text, grown, may begin again: at index `at`, read by `reader`
    (None: the same format). The first `calls` calls lie before `at` and are whole. While
    `content`, the content is the text before `at` then what the scan from `at` finds; else
    the content is all known (nothing after `at` adds to it before the output is whole)."""

    at: int
    calls: int = 0
    content: bool = True
    reader: ToolCallFormat | None = None


@dataclass(slots=True)
class Scan:
    content: str
    calls: list[PartialCall] = field(default_factory=list)
    broken: bool = False  # final scans only: a call that does not parse
    resume: Resume | None = None  # streamed scans: None, scan the whole text again


def text_until(text: str, marker: str, reader: ToolCallFormat | None = None) -> Scan:
    """Text without `marker` (a streamed scan): content but a tail that may start it, and
    the scan goes on from that tail."""
    at = len(text) - stop_prefix_len(text, (marker,))
    return Scan(text[:at], resume=Resume(at, reader=reader))


class ToolCallFormat:
    """Base of the formats: `name`, the chat-template `markers` that identify it, `scan`
    and the `constraint` for required / named calls."""

    name = ""
    markers: tuple[str, ...] = ()
    instructions = ""  # how to call, for a system prompt (templates that do not render tools)
    # The family writes its call markers as special tokens: its output is read with them kept
    # (a decode that skips special tokens drops the markers and hides the calls).
    special_tokens = False

    def bind(self, functions: list[dict]) -> ToolCallFormat:
        """The format for a request offering `functions` (OpenAI function objects): formats
        whose argument values are untyped text read them by each function's parameters
        schema and return a copy that knows them; the others return themselves."""
        return self

    def scan(self, text: str, final: bool) -> Scan:
        """The content and calls of `text` (`final`: the whole output). A streamed scan may
        say where the next one can begin (`Scan.resume`); without it the stream scans the
        whole text again."""
        raise NotImplementedError

    def constraint(
        self, calls: list[dict], single: bool, parallel: bool, conversion: Conversion
    ) -> dict[str, Any]:
        """{"regex": ...} or {"json_schema": ...}: one call when `single` or not `parallel`,
        else one or more, each of the `calls` schemas (see `call_schema`)."""
        raise NotImplementedError

    def structural_tag(self, functions: list[dict], parallel: bool) -> dict[str, Any]:
        """The structural tag (constrained/backends/structural_tag.py) of what tool_choice "auto" may
        write: free text until the call marker, then a call of one of the `functions` whose
        arguments follow its `parameters` exactly, then free text or (when `parallel`) the
        next call."""
        raise NotImplementedError


def call_schema(function: dict[str, Any], arguments_key: str = "arguments") -> dict[str, Any]:
    """One call of `function`: {"name": <its name>, <arguments_key>: <its parameters>}."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            arguments_key: function.get("parameters") or ANY_OBJECT,
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def any_call_schema(
    functions: list[dict[str, Any]], arguments_key: str = "arguments"
) -> dict[str, Any]:
    calls = [call_schema(f, arguments_key) for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A non-empty array of calls of any of the functions (one call when not parallel)."""
    schema = {"type": "array", "items": any_call_schema(functions), "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def repeated(item: str, separator: str, many: bool) -> str:
    return f"{item}(?:{separator}{item})*" if many else item


def json_call(body: str, start: int, final: bool) -> tuple[PartialCall | None, int | None, bool]:
    """(the call so far or None before its name, index past it or None, whether it is
    broken) of the JSON call object at `start`."""
    members, end = object_members(body, start)
    by_key = {m.key: m for m in members}
    name_member = by_key.get("name")
    if final and end is None:
        return None, None, True
    if name_member is None or name_member.end is None:
        return None, end, end is not None
    try:
        name = json.loads(body[name_member.start : name_member.end])
    except (ValueError, RecursionError):  # a number past Python's digit limit, deep nesting
        return None, end, True
    arguments = next((by_key[k] for k in ARGUMENT_KEYS if k in by_key), None)
    if not isinstance(name, str):
        return None, end, True
    if arguments is None:  # no arguments member (yet): none once the object is closed
        return PartialCall(name, "" if end is None else "{}", end is not None), end, False
    text = body[arguments.start : len(body) if arguments.end is None else arguments.end]
    return (
        PartialCall(name, text if arguments.end is not None else text.rstrip(), end is not None),
        end,
        False,
    )


def json_calls(
    text: str, start: int, final: bool, separator: str = ",", close: str | None = None
) -> Scan:
    """The call objects from `start` on, separated by `separator`, up to `close` or the end."""
    scan = Scan("")
    i = skip_space(text, start)
    while i < len(text):
        if text[i] != "{":
            scan.broken = not (
                close is not None and text[i] == close and skip_space(text, i + 1) == len(text)
            )
            return scan
        call, end, broken = json_call(text, i, final)
        if broken:
            scan.broken = True
            return scan
        if call is not None:
            scan.calls.append(call)
        if end is None:
            return scan
        i = skip_space(text, end)
        if i < len(text) and text[i] == separator:
            i = skip_space(text, i + 1)
    scan.broken = final and (close is not None or not scan.calls)
    return scan


class Cursor:
    """Reads a call block left to right: `at` tells whether a word comes next (None while the
    text ends inside it: undecided until more arrives), `take` consumes it, `upto` reads to
    the next occurrence of a word (None while it has not arrived)."""

    def __init__(self, text: str, i: int) -> None:
        self.text, self.i = text, i

    @property
    def at_end(self) -> bool:
        return self.i >= len(self.text)

    def space(self) -> None:
        self.i = skip_space(self.text, self.i)

    def at(self, word: str) -> bool | None:
        piece = self.text[self.i : self.i + len(word)]
        if piece == word:
            return True
        return None if len(piece) < len(word) and word.startswith(piece) else False

    def take(self, word: str) -> bool:
        if self.at(word):
            self.i += len(word)
            return True
        return False

    def upto(self, word: str) -> str | None:
        end = self.text.find(word, self.i)
        if end < 0:
            return None
        out, self.i = self.text[self.i : end], end + len(word)
        return out


# What a block reader answers: the calls read so far, the index past the block (None while
# it is still arriving) and whether the block is no calls of the format.
Block = tuple[list[PartialCall], int | None, bool]


class BlockFormat(ToolCallFormat):
    """Formats whose calls come in blocks from `open_tag` to `close_tag` inside free text;
    `read_block` reads one block from its `open_tag` on. Content is the text around the
    blocks (streamed up to the first block, the rest once the output is whole)."""

    open_tag = close_tag = ""

    def read_block(self, text: str, start: int) -> Block:
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(self.open_tag)
        if first < 0:
            return Scan(text) if final else text_until(text, self.open_tag)
        scan, outside, start = Scan(text[:first], resume=Resume(first)), [text[:first]], first
        while True:
            calls, end, broken = self.read_block(text, start)
            scan.calls += calls
            if broken or end is None:
                scan.broken = broken or final
                break
            start = text.find(self.open_tag, end)
            scan.resume = after_block(text, end, start, self.open_tag, len(scan.calls))
            outside.append(text[end : len(text) if start < 0 else start])
            if start < 0:
                break
        if final:
            scan.content = "".join(outside).strip()
        return scan


def after_block(text: str, end: int, following: int, open_tag: str, calls: int) -> Resume:
    """Where a scan of blocks in text begins again after a block closed at `end` (the next
    one opens at `following`, -1: none yet): there, or past the text after it that cannot
    start a block."""
    if following >= 0:
        return Resume(end, calls, content=False)
    at = max(end, len(text) - stop_prefix_len(text, (open_tag,)))
    return Resume(at, calls, content=False)


class PlainText(ToolCallFormat):
    """The reader of an output that a format has found to be text, no calls: all of it is
    content (a stream's reader from there on)."""

    name = "plain text"

    def scan(self, text: str, final: bool) -> Scan:
        return Scan(text, resume=Resume(len(text)))


PLAIN_TEXT = PlainText()
