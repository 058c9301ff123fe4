"""Structural tags -> a grammar in llguidance's Lark dialect.

A structural tag describes output that mixes free text with exact regions: "any text until
`<tool_call>`, then this JSON schema, then `</tool_call>`, then text or the next call".
Two forms are accepted (the field names are XGrammar's, SGLang and vLLM pass them through):

    {"type": "structural_tag", "format": FORMAT}
    {"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}

The second (older) form is `triggered_tags` with one `json_schema` tag per structure. A
FORMAT is an object with a `type` (inferred from its keys when missing):

    const_string         {"value": str}                       exactly that text ("" too)
    json_schema          {"json_schema": object | bool}       JSON that the schema accepts
    grammar              {"grammar": str}                     a GBNF / EBNF (or Lark) grammar
    regex                {"pattern": str}                     a regex (Rust `regex` syntax)
    any_text             {"excludes": [str]?}                 any text (without those strings)
    sequence             {"elements": [FORMAT]}               one after the other
    or                   {"elements": [FORMAT]}               one of them
    tag                  {"begin": str, "content": FORMAT, "end": str | [str]}
    triggered_tags       {"triggers": [str], "tags": [TAG], "at_least_one": bool?,
                          "stop_after_first": bool?, "excludes": [str]?}
    tags_with_separator  {"tags": [TAG], "separator": str, "at_least_one": bool?,
                          "stop_after_first": bool?}

`any_text` and `triggered_tags` have no end of their own: they run to the end of the
output, or, as (the last part of) a tag's content, to the first of the tag's `end` strings.
So they may only come last in a sequence. `triggered_tags`: free text; where a trigger
appears the text stops and one of the tags whose `begin` starts with that trigger follows,
then free text again. `at_least_one`: the output starts with a tag; `stop_after_first`:
nothing but the enclosing end after the first tag.

How it maps onto llguidance (docs/syntax.md of llguidance): free text up to a string is a
*lazy* lexeme (`/(?s:.*)/` followed by the string, matched as soon as the string appears, so
a trigger written in free text always starts its tag); JSON schemas are inline `%json`,
grammars inline `%lark`, `excludes` a terminal `& ~/.*X.*/`. A schema is written as a
`json_schema` constraint's is (llguidance_text.prepared_schema: objects closed, numbers
bounded). A string that is a special token of the vocabulary (`<|python_tag|>`,
`[TOOL_CALLS]`) is matched as that token (`<[id]>`), never spelled out in ordinary tokens:
pass the vocabulary's `special_tokens` (text -> id).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import llguidance

from spruce.constrained.backends.llguidance_text import (
    check_grammar,
    ebnf_grammar,
    nested_lark,
    prepared_schema,
)
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.schema.schema_context import SchemaOptions

# A tool list of OpenAI's 128 functions is ~400 formats (tag, content, schema); nesting past
# a dozen levels is never a real format. Both bound the walk and the grammar's size (the
# request's text is bounded by --max-constraint-chars before it gets here).
MAX_FORMATS = 2048
MAX_DEPTH = 32

ROOT = "structural_tag"
TYPES = (
    "const_string", "json_schema", "grammar", "regex", "any_text", "sequence", "or", "tag",
    "triggered_tags", "tags_with_separator",
)  # fmt: skip
# A format without "type" is known by its first key found here (XGrammar infers it too).
TYPE_BY_KEY = (
    ("begin", "tag"), ("value", "const_string"), ("json_schema", "json_schema"),
    ("pattern", "regex"), ("grammar", "grammar"), ("triggers", "triggered_tags"),
    ("separator", "tags_with_separator"), ("elements", "sequence"),
)  # fmt: skip
UNBOUNDED = ("any_text", "triggered_tags")  # run to the enclosing tag's end (or the output's)
# JSON inside a tag: one space after `,` and `:` (as models write tool calls), no other white
# space (flexible white space lets a small model pad forever); a schema's own x-guidance wins.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def structural_tag_to_lark(tag: Any, special_tokens: Mapping[str, int] | None = None) -> str:
    """The Lark grammar (start rule `start`) for a structural tag in either form (a dict or
    its JSON text). `special_tokens`: the vocabulary's special tokens, text -> id; strings in
    the tag that contain them match those tokens. ConstraintError naming the field if bad."""
    if isinstance(tag, str):
        tag = _loads(tag, ROOT)
    writer = _Writer(special_tokens or {})
    return writer.text(writer.format(*_root_format(tag), (), 0))


def _loads(text: str, path: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConstraintError(f"{path} is not valid JSON: {e}") from None


def _root_format(tag: Any) -> tuple[dict, str]:
    """The `format` tree and its path; the older form is triggered_tags whose tags give a
    `schema` for their content (a tag may, see `_Writer.tag_body`)."""
    _expect(isinstance(tag, dict), ROOT, "must be an object")
    _expect(tag.get("type", ROOT) == ROOT, f"{ROOT}.type", f"must be {ROOT!r}")
    if "format" in tag:
        return tag["format"], f"{ROOT}.format"
    _expect("structures" in tag, ROOT, "needs a 'format' (or 'structures' and 'triggers')")
    return {
        "type": "triggered_tags",
        "triggers": tag.get("triggers"),
        "structures": tag["structures"],
    }, ROOT


class _Writer:
    """Writes one rule per format; `ends` are the end strings of the tag whose content an
    unbounded format (any_text, triggered_tags) runs up to, and consumes."""

    def __init__(self, special_tokens: Mapping[str, int]) -> None:
        self.rules: list[str] = []
        self.count = 0
        self.special_tokens = special_tokens
        self._special = _special_pattern(tuple(special_tokens))

    def text(self, root: str) -> str:
        return "\n".join(["%llguidance {}", f"start: {root}", *self.rules]) + "\n"

    def rule(self, body: str, options: str = "") -> str:
        name = f"st_{len(self.rules)}"
        self.rules.append(f"{name}{options}: {body}")
        return name

    def terminal(self, body: str) -> str:
        name = f"ST_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def format(self, node: Any, path: str, ends: tuple[str, ...], depth: int) -> str:
        self.count += 1
        _expect(self.count <= MAX_FORMATS, ROOT, f"has over {MAX_FORMATS} formats")
        _expect(depth <= MAX_DEPTH, path, f"nests formats over {MAX_DEPTH} deep")
        kind = _type_of(node, path)
        return getattr(self, f"_{kind}")(node, path, ends, depth + 1)

    # -- formats with a fixed end -------------------------------------------------------

    def _const_string(self, node: dict, path: str, ends: tuple, depth: int) -> str:
        return self.rule(self.literal(_string(node, "value", path, allow_empty=True)))

    def _json_schema(self, node: dict, path: str, ends: tuple, depth: int) -> str:
        _expect("json_schema" in node, path, "needs a 'json_schema'")
        _expect(
            node.get("style", "json") == "json",
            f"{path}.style",
            "must be 'json' (the only style supported)",
        )
        return self.schema(node["json_schema"], f"{path}.json_schema")

    def schema(self, schema: Any, path: str) -> str:
        if isinstance(schema, str):
            schema = _loads(schema, path)
        _expect(isinstance(schema, (dict, bool)), path, "must be an object or a boolean")
        schema = prepared_schema(schema, SchemaOptions())  # as a json_schema constraint's
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": JSON_OPTIONS}
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        check_grammar(llguidance.LLMatcher.grammar_from_json_schema(text), path)
        return self.rule(f"%json {text}")

    def _grammar(self, node: dict, path: str, ends: tuple, depth: int) -> str:
        text = _string(node, "grammar", path)
        try:
            grammar = ebnf_grammar(text)  # converted to Lark and checked
        except ConstraintError as e:
            raise ConstraintError(f"{path}.grammar{str(e).removeprefix('ebnf')}") from None
        return self.rule(nested_lark(grammar))

    def _regex(self, node: dict, path: str, ends: tuple, depth: int) -> str:
        body = _regex_body(_string(node, "pattern", path), f"{path}.pattern")
        return self.rule(self.terminal(_excluding(f"/{body}/", node, path)))

    def _sequence(self, node: dict, path: str, ends: tuple, depth: int) -> str:
        elements = _elements(node, path)
        names = []
        for i, element in enumerate(elements):
            last = i == len(elements) - 1
            if not last and _unbounded(element, f"{path}.elements[{i}]"):
                raise ConstraintError(
                    f"{path}.elements[{i}]: any_text and triggered_tags have no end of their own: "
                    "only the last element of a sequence can be one"
                )
            names.append(self.format(element, f"{path}.elements[{i}]", ends if last else (), depth))
        return self.rule(" ".join(names))

    def _or(self, node: dict, path: str, ends: tuple, depth: int) -> str:
        elements = _elements(node, path)
        unbounded = {_unbounded(e, f"{path}.elements[{i}]") for i, e in enumerate(elements)}
        _expect(
            len(unbounded) == 1,
            f"{path}.elements",
            "must all be unbounded (any_text, triggered_tags) or none",
        )
        names = [
            self.format(e, f"{path}.elements[{i}]", ends, depth) for i, e in enumerate(elements)
        ]
        return self.rule(" | ".join(names))

    def _tag(self, node: dict, path: str, ends: tuple, depth: int) -> str:
        begin, rest = self.tag_parts(node, path, depth)
        return self.rule(f"{self.literal(begin)} {rest}")

    def tag_parts(self, node: Any, path: str, depth: int) -> tuple[str, str]:
        """(begin, the content and end as Lark); an unbounded content consumes the end. A
        `schema` (JSON schema, or its text) may stand for a json_schema content (the older
        form's structures)."""
        _expect(isinstance(node, dict), path, "must be an object")
        _expect(node.get("type", "tag") == "tag", f"{path}.type", "must be 'tag'")
        begin = _string(node, "begin", path, allow_empty=True)
        tag_ends = _ends(node, path)
        if "content" not in node and "schema" in node:
            self.count += 1
            end = " | ".join(self.literal(e) for e in tag_ends)
            return begin, f"{self.schema(node['schema'], f'{path}.schema')} ({end})"
        _expect("content" in node, path, "needs a 'content'")
        if _unbounded(node["content"], f"{path}.content"):
            _expect(
                any(tag_ends),
                f"{path}.end",
                "must be non-empty when the content is any_text or triggered_tags",
            )
            content = self.format(
                node["content"], f"{path}.content", tuple(e for e in tag_ends if e), depth
            )
            return begin, content
        content = self.format(node["content"], f"{path}.content", (), depth)
        end = " | ".join(self.literal(e) for e in tag_ends)
        return begin, f"{content} ({end})"

    def _tags_with_separator(self, node: dict, path: str, ends: tuple, depth: int) -> str:
        tags = _list(node.get("tags"), f"{path}.tags", non_empty=True)
        separator = _string(node, "separator", path, allow_empty=True)
        at_least_one, stop_after_first = _flags(node, path)
        parts = [self.tag_parts(t, f"{path}.tags[{i}]", depth) for i, t in enumerate(tags)]
        one = self.rule(" | ".join(f"{self.literal(begin)} {rest}" for begin, rest in parts))
        many = one if stop_after_first else f"{one} ({self.literal(separator)} {one})*"
        return self.rule(many if at_least_one else f"({many})?")

    # -- formats that run to the enclosing end --------------------------------------------

    def _any_text(self, node: dict, path: str, ends: tuple, depth: int) -> str:
        return self.rule(self.until(self.terminal(_excluding("/(?s:.*)/", node, path)), ends))

    def until(self, text: str, ends: tuple[str, ...]) -> str:
        """Free text (terminal `text`) then the first of `ends`; to the output's end if none.
        A plain end is a lazy lexeme (the text stops where the end first appears); a special
        token cannot be in text, so it simply follows it."""
        if not ends:
            return text
        return " | ".join(f"({self.triggered(text, end)})" for end in ends)

    def _triggered_tags(self, node: dict, path: str, ends: tuple, depth: int) -> str:
        triggers = _strings(node.get("triggers"), f"{path}.triggers", non_empty=True)
        _expect(all(triggers), f"{path}.triggers", "must be non-empty strings")
        key = "tags" if "tags" in node or "structures" not in node else "structures"
        tags = _list(node.get(key), f"{path}.{key}", non_empty=True)
        at_least_one, stop_after_first = _flags(node, path)
        text = self.terminal(_excluding("/(?s:.*)/", node, path))
        after: dict[str, list[str]] = {}  # trigger -> what follows it, per tag
        firsts = []
        for i, tag in enumerate(tags):
            tag_path = f"{path}.{key}[{i}]"
            trigger = _trigger_of(tag, triggers, tag_path, path)
            begin, rest = self.tag_parts(tag, tag_path, depth)
            after.setdefault(trigger, []).append(f"{self.literal(begin[len(trigger) :])} {rest}")
            firsts.append(f"{self.literal(begin)} {rest}")
        calls = [f"{self.triggered(text, t)} ({' | '.join(rests)})" for t, rests in after.items()]
        call = self.rule(" | ".join(calls))
        first = self.rule(" | ".join(firsts)) if at_least_one else ""
        tail = self.until(text, ends)
        end = " | ".join(self.literal(e) for e in ends) if ends else ""
        if at_least_one and stop_after_first:
            return self.rule(f"{first} {f'({end})' if end else ''}")
        if at_least_one:
            return self.rule(f"{first} {call}* ({tail})")
        if stop_after_first:
            return self.rule(f"{call} {f'({end})' if end else ''} | {tail}")
        return self.rule(f"{call}* ({tail})")

    def triggered(self, text: str, trigger: str) -> str:
        """Free text (terminal `text`) up to and including `trigger`: a lazy lexeme ending
        where the trigger first appears, or, for a special token (never in text), the token
        after the text."""
        first, rest = self.split_first(trigger)
        if first.startswith("<["):
            return f"{text} {first} {rest}"
        return f"{self.rule(f'{text} {first}', '[lazy]')} {rest}"

    # -- literals -------------------------------------------------------------------------

    def literal(self, text: str) -> str:
        """Text as Lark: string literals, and `<[id]>` for the special tokens in it."""
        return " ".join(self.pieces(text)) or '""'

    def pieces(self, text: str) -> list[str]:
        if self._special is None:
            return [_quoted(text)] if text else []
        out, at = [], 0
        for found in self._special.finditer(text):
            if found.start() > at:
                out.append(_quoted(text[at : found.start()]))
            out.append(f"<[{self.special_tokens[found.group()]}]>")
            at = found.end()
        if at < len(text):
            out.append(_quoted(text[at:]))
        return out

    def split_first(self, text: str) -> tuple[str, str]:
        """(the first piece of `text`, the rest as Lark)."""
        pieces = self.pieces(text)
        return pieces[0], " ".join(pieces[1:])


def _special_pattern(texts: tuple[str, ...]) -> re.Pattern | None:
    """One regex finding the special tokens in a text, longest first where they overlap."""
    texts = tuple(t for t in texts if t)
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _excluding(regex: str, node: dict, path: str) -> str:
    """A terminal: `regex` without any of the node's `excludes` strings inside."""
    excludes = _strings(node.get("excludes", []), f"{path}.excludes")
    _expect(all(excludes), f"{path}.excludes", "must be non-empty strings")
    if not excludes:
        return regex
    inner = "|".join(re.escape(x).replace("/", "\\/") for x in excludes)
    return f"{regex} & ~/(?s:.*)(?:{inner})(?s:.*)/"


def _regex_body(pattern: str, path: str) -> str:
    body = llguidance.regex_to_lark(pattern)
    check_grammar(llguidance.LLMatcher.grammar_from_lark(f"start: /{body}/"), path)
    return body


def _trigger_of(tag: Any, triggers: list[str], tag_path: str, path: str) -> str:
    """The one trigger that starts the tag's begin."""
    _expect(isinstance(tag, dict), tag_path, "must be an object")
    begin = _string(tag, "begin", tag_path, allow_empty=True)
    matched = [t for t in triggers if begin.startswith(t)]
    _expect(
        len(matched) == 1,
        f"{tag_path}.begin",
        f"must start with exactly one of {path}.triggers (it starts with {len(matched)})",
    )
    return matched[0]


def _type_of(node: Any, path: str) -> str:
    _expect(isinstance(node, dict), path, "must be an object")
    kind = node.get("type")
    if kind is None:
        kind = next((t for key, t in TYPE_BY_KEY if key in node), None)
        _expect(kind is not None, path, f"needs a 'type' (one of {', '.join(TYPES)})")
    _expect(
        kind in TYPES, f"{path}.type", f"must be one of {', '.join(TYPES)} (got {str(kind)[:40]!r})"
    )
    return kind


def _unbounded(node: Any, path: str) -> bool:
    """Whether the format runs to the enclosing end (checked before it is written)."""
    kind = _type_of(node, path)
    if kind in ("sequence", "or"):
        elements = _elements(node, path)
        if kind == "sequence":
            return _unbounded(elements[-1], f"{path}.elements[{len(elements) - 1}]")
        return any(_unbounded(e, f"{path}.elements[{i}]") for i, e in enumerate(elements))
    return kind in UNBOUNDED


def _elements(node: dict, path: str) -> list:
    return _list(node.get("elements"), f"{path}.elements", non_empty=True)


def _ends(node: dict, path: str) -> list[str]:
    end = node.get("end")
    if isinstance(end, str):
        return [end]
    return _strings(
        end, f"{path}.end", non_empty=True, what="must be a string or a list of strings"
    )


def _flags(node: dict, path: str) -> tuple[bool, bool]:
    flags = []
    for name in ("at_least_one", "stop_after_first"):
        value = node.get(name, False)
        _expect(isinstance(value, bool), f"{path}.{name}", "must be a boolean")
        flags.append(value)
    return flags[0], flags[1]


def _string(node: dict, key: str, path: str, allow_empty: bool = False) -> str:
    value = node.get(key)
    _expect(isinstance(value, str), f"{path}.{key}", "must be a string")
    _expect(allow_empty or value != "", f"{path}.{key}", "must not be empty")
    return value


def _list(value: Any, path: str, non_empty: bool = False) -> list:
    _expect(isinstance(value, list), path, "must be a list")
    _expect(not non_empty or len(value) > 0, path, "must not be empty")
    return value


def _strings(
    value: Any, path: str, non_empty: bool = False, what: str = "must be a list of strings"
) -> list[str]:
    _expect(isinstance(value, list) and all(isinstance(v, str) for v in value), path, what)
    _expect(not non_empty or len(value) > 0, path, "must not be empty")
    return value


def _expect(condition: bool, path: str, message: str) -> None:
    if not condition:
        raise ConstraintError(f"{path} {message}")
