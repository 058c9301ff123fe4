"""Each constraint kind as llguidance's grammar text, checked (syntax errors with their line
and column). No torch here: the conversion workers import this module.

    grammar = lark_grammar('start: "yes" | "no"')
    grammar = ebnf_grammar('root ::= "Hello" | "Hi"')         # GBNF / XGrammar's EBNF
    grammar, unenforced = schema_grammar(schema, options, lenient=True)  # ConstraintError if refused
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from spruce.constrained.backends.llguidance_errors import plain_error
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.schema.schema_context import SchemaOptions
from spruce.constrained.schema.schema_refs import remote_refs

# Per-mask work is bounded by llguidance's fuel: a step's lexer fuel at ~14k/ms and its Earley
# items at ~20k/ms keep one mask under ~15 ms (past them the request fails, the batch goes on).
# Lexer states cost 1-2 kB each: 50,000 holds one grammar's lexer to ~100 MB.
LIMITS = dict(step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=50_000)


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def check_grammar(grammar: str, what: str) -> list[str]:
    """The grammar's warnings; ConstraintError naming `what` when it does not compile.
    Checked without the vocabulary: a special token a grammar names is checked when the
    grammar is compiled for the model."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=limits()
    )
    if is_error:
        raise ConstraintError(f"{what}: {plain_error(messages[0])}")
    return messages


def lark_grammar(text: str, what: str = "lark") -> str:
    if not isinstance(text, str) or not text.strip():
        raise ConstraintError(f"{what} must be a non-empty grammar text")
    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    check_grammar(grammar, what)
    return grammar


_BLOCK_START = re.compile(r"%\w+\s*\{")  # a directive's block: %json {...}, %llguidance {...}


def special_literals_as_tokens(lark: str, specials: dict[str, int]) -> str:
    """`lark` with each quoted literal whose text is a special token's (`"<|im_end|>"`)
    written as a reference to that token (`<[2]>`): llguidance's mask offers the token there,
    and only the reference makes its matcher take it. Comments, regexes, case-insensitive
    literals and `%json {...}`-style blocks are left as they are."""
    out, i, n = [], 0, len(lark)
    while i < n:
        end = _skipped_span(lark, i)
        if end > i:
            out.append(lark[i:end])
            i = end
        elif lark[i] == '"':
            end = _string_end(lark, i)
            text = _literal_text(lark[i:end])
            flagged = end < n and lark[end] == "i"
            out.append(f"<[{specials[text]}]>" if text in specials and not flagged else lark[i:end])
            i = end
        else:
            out.append(lark[i])
            i += 1
    return "".join(out)


def _skipped_span(lark: str, i: int) -> int:
    """Where a comment, a regex or a `%name {...}` block starting at i ends (i: none)."""
    if lark.startswith("//", i):
        end = lark.find("\n", i)
        return len(lark) if end < 0 else end
    if lark[i] == "/":
        return _string_end(lark, i)
    match = _BLOCK_START.match(lark, i)
    return _block_end(lark, match.end() - 1) if match else i


def _string_end(lark: str, i: int) -> int:
    """The index after the literal or regex opened at i (its quote, escapes skipped)."""
    quote, j = lark[i], i + 1
    while j < len(lark) and lark[j] != quote:
        j += 2 if lark[j] == "\\" else 1
    return min(j + 1, len(lark))


def _block_end(lark: str, i: int) -> int:
    """The index after the `{...}` opened at i (braces inside JSON strings skipped)."""
    depth, j = 0, i
    while j < len(lark):
        if lark[j] == '"':
            j = _string_end(lark, j)
            continue
        depth += {"{": 1, "}": -1}.get(lark[j], 0)
        j += 1
        if depth == 0:
            return j
    return j


def _literal_text(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:
        return None


def ebnf_grammar(text: str) -> str:
    """GBNF (llama.cpp's dialect, which XGrammar's EBNF and SGLang's `ebnf` share), root
    rule `root`, through llguidance's converter to Lark. A known difference from llama.cpp:
    the converter makes a rule of terminals only a lexeme, which llguidance's lexer matches
    greedily (arithmetic.gbnf's `num ::= [0-9]+ ws` eats the newline its root needs)."""
    if not isinstance(text, str) or not text.strip():
        raise ConstraintError("ebnf must be a non-empty grammar text")
    try:
        lark = gbnf_to_lark(text)
    except GbnfToLarkError as e:
        raise ConstraintError(
            f"ebnf: {_gbnf_position(e)}{e.args[0].split(' at line ')[0]}"
        ) from None
    except RecursionError:
        raise ConstraintError("ebnf is nested too deeply") from None
    except Exception as e:  # noqa: BLE001 - the converter's way to say a rule or root is missing
        raise ConstraintError(f"ebnf: {e}") from None
    return lark_grammar(lark, "ebnf")


def _gbnf_position(error: GbnfToLarkError) -> str:
    text, pos = error.pos.text, error.pos.pos
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"line {line}, column {column}: "


def nested_lark(grammar: str) -> str:
    """llguidance's grammar text (Lark, or its JSON form holding one Lark grammar or JSON
    schema: `ConstraintSpec.grammar`) as a Lark expression to embed in another grammar: a
    `%lark {...}` block (its rules keep their own names) or `%json {...}`."""
    if grammar.lstrip().startswith("{"):
        (top,) = json.loads(grammar)["grammars"]
        if top.get("json_schema") is not None:
            return "%json " + json.dumps(top["json_schema"], ensure_ascii=False)
        grammar = top["lark_grammar"]
    return "%lark {\n" + grammar + "\n}"


def regex_grammar(regex: str) -> str:
    grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    check_grammar(grammar, "regex")
    return grammar


def schema_grammar(
    schema: Any, options: SchemaOptions, lenient: bool, check: bool = True
) -> tuple[str, tuple[str, ...]]:
    """(the grammar, the keywords it leaves unenforced) of a JSON schema; ConstraintError
    with llguidance's reason when it cannot take it, or (`lenient` False) cannot enforce all
    of it: a keyword it does not implement, a `oneOf` it cannot prove exclusive, a `format`
    it does not know. Written as the spruce converter writes JSON (see _prepared): objects
    closed unless `options.open_objects` or the schema intersects object schemas
    (_INTERSECTING), numbers bounded, whitespace `options.whitespace_pattern`; in lenient
    mode a `$ref` to another document allows any value there (reported as `$ref`).
    Unchecked (`check` False), the grammar is not built here: what it leaves unenforced but
    that `$ref` comes from the compile (`unenforced_of`), which also says if it is refused."""
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(
            f"a JSON schema must be an object or a boolean (got {json.dumps(schema)[:80]})"
        )
    remote = frozenset(remote_refs(schema)) if lenient else frozenset()
    if remote:
        schema = _without_remote_refs(schema, remote)
    schema = prepared_schema(schema, options)
    overrides: dict[str, Any] = {
        "item_separator": ",",
        "key_separator": ":",
        "whitespace_flexible": False,
    }
    if options.whitespace_pattern:
        overrides["whitespace_pattern"] = options.whitespace_pattern
    if lenient:
        overrides["lenient"] = True
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
    except ValueError as e:
        raise ConstraintError(f"json_schema: {e}") from None
    return grammar, unenforced_of(
        check_grammar(grammar, "json_schema") if check else [], ("$ref",) * bool(remote)
    )


def unenforced_of(warnings: list[str], known: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The keywords a lenient schema grammar leaves out: those llguidance's warnings name,
    then those already `known` (a `$ref` to another document)."""
    unenforced = _unimplemented(warnings)
    return unenforced + tuple(name for name in known if name not in unenforced)


def _without_remote_refs(node: Any, remote: frozenset[str]) -> Any:
    """A copy of the schema where a `$ref` to another document (no network to fetch it)
    allows any value, as the spruce converter reads it in lenient mode: the `$ref` becomes
    `anyOf: [{}]` (an applicator, so an object beside it stays open)."""
    if isinstance(node, list):
        return [_without_remote_refs(item, remote) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        k: v if k in _DATA_KEYWORDS else _without_remote_refs(v, remote) for k, v in node.items()
    }
    if isinstance(out.get("$ref"), str) and out["$ref"] in remote:
        del out["$ref"]
        if not _APPLICATORS & out.keys():
            out["anyOf"] = [{}]
    return out


def _unimplemented(warnings: list[str]) -> tuple[str, ...]:
    """The keywords llguidance's warnings say it leaves out (lenient mode)."""
    found: list[str] = []
    for warning in warnings:
        match = re.search(r"Unimplemented keys: (\[.*?\])", warning)
        names = json.loads(match.group(1)) if match else []
        if warning.startswith("oneOf not fully supported"):
            names = ["oneOf"]  # approximated by anyOf
        elif warning.startswith("Unknown format"):
            names = ["format"]
        elif warning.startswith("min/maxProperties"):
            names = ["minProperties", "maxProperties"]
        found += [name for name in names if name not in found]
    return tuple(found)


# Keywords that combine an object schema with another one (an intersection): closing the
# parts would refuse what the whole allows, so a schema using them keeps its objects open.
_INTERSECTING = frozenset(
    {
        "allOf",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependencies",
        "not",
        "unevaluatedProperties",
    }
)
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas


def _intersects(node: Any) -> bool:
    if isinstance(node, list):
        return any(_intersects(item) for item in node)
    if not isinstance(node, dict):
        return False
    if _INTERSECTING & node.keys() and not _plain_all_of(node):
        return True
    return any(_intersects(value) for key, value in node.items() if key not in _DATA_KEYWORDS)


_PLAIN_OBJECT_KEYS = frozenset({"type", "properties", "required", "title", "description"})


def _plain_all_of(node: dict) -> bool:
    """An allOf of plain object schemas (properties and required only, as pydantic writes
    a model that extends another): closed together, see _closed_all_of."""
    parts = node.get("allOf")
    if not isinstance(parts, list) or not parts or (_INTERSECTING - {"allOf"}) & node.keys():
        return False
    if "additionalProperties" in node or node.get("type", "object") != "object":
        return False
    return all(
        isinstance(p, dict)
        and p.keys() <= _PLAIN_OBJECT_KEYS
        and p.get("type", "object") == "object"
        and isinstance(p.get("properties", {}), dict)
        for p in parts
    )


def _closed_all_of(node: dict) -> list:
    """The allOf parts of a plain allOf (see _plain_all_of), each closed over every name any
    part (or the node itself) declares: together they allow exactly those properties."""
    names = dict.fromkeys(
        node.get("properties", {}) if isinstance(node.get("properties"), dict) else {}
    )
    for part in node["allOf"]:
        names.update(dict.fromkeys(part.get("properties", {})))
    return [{**part, "properties": {**{n: {} for n in names}, **part.get("properties", {})}, "additionalProperties": False}
            for part in node["allOf"]]  # fmt: skip


_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions"}
)  # name -> schema


INTEGER_BOUND = (
    10**16 - 1
)  # as the spruce converter writes a number's integer part: -?(0|[1-9][0-9]{0,15})
# A number's fraction digits, at most 10 (llguidance takes no finer multipleOf; the spruce
# converter allows 16): without a bound a small model writes digits until its token limit.
FRACTION_STEP = 1e-10
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


_OBJECT_KEYS = frozenset(
    {"properties", "patternProperties", "additionalProperties", "required", "propertyNames"}
)
_APPLICATORS = frozenset(
    {
        "$ref",
        "anyOf",
        "oneOf",
        "allOf",
        "if",
        "then",
        "else",
        "not",
        "dependentSchemas",
        "dependencies",
    }
)


@dataclass(slots=True)
class _How:
    """How _prepared writes a schema: `close` objects (but the definitions in `keep_open`);
    `share` bounded numbers as `$ref`s to one definition each (_SHARED_NUMBERS). `ids`:
    the schemas with their own `$id` it met (the walk counts them); `shared`: the
    definitions it referred to."""

    close: bool
    keep_open: frozenset[str]
    share: bool
    ids: int = 0
    shared: set[str] = field(default_factory=set)


def prepared_schema(schema: Any, options: SchemaOptions) -> Any:
    """A copy of the schema as the spruce converter writes JSON, for llguidance wherever a
    schema goes (a `json_schema` constraint, a structural tag's `%json`, so tool calls too):
    objects closed unless `options.open_objects` or the schema intersects object schemas
    (_INTERSECTING), numbers without bounds bounded (INTEGER_BOUND, FRACTION_STEP)."""
    close = not options.open_objects and not _intersects(schema)
    keep_open = frozenset(_refs_beside_object_keys(schema)) if close else frozenset()
    return _with_bounds(schema, close, keep_open)


def _with_bounds(schema: Any, close: bool, keep_open: frozenset[str]) -> Any:
    """_prepared's copy, with the shared number definitions at the root where every `$ref`
    to them reaches it (no subschema sets its own base URI, the names are free)."""
    defs = schema.get("$defs") if isinstance(schema, dict) else None
    share = isinstance(schema, dict) and not (
        isinstance(defs, dict) and _SHARED_NUMBERS.keys() & defs.keys()
    )
    how = _How(close, keep_open, share)
    out = _prepared(schema, how)
    if not share:
        return out
    if how.ids > _own_id(schema):  # a `#/$defs/...` inside would not reach the root: inline
        return _prepared(schema, _How(close, keep_open, False))
    if how.shared:
        used = {name: _SHARED_NUMBERS[name] for name in sorted(how.shared)}
        out["$defs"] = {**(out["$defs"] if isinstance(defs, dict) else {}), **used}
    return out


def _own_id(node: dict) -> bool:
    return isinstance(node.get("$id"), str) or isinstance(node.get("id"), str)


def _prepared(node: Any, how: _How, here: bool = True) -> Any:
    """A copy of the schema with numbers without bounds bounded to INTEGER_BOUND and their
    fractions to FRACTION_STEP, and objects closed (`how.close`): an object schema with
    `properties` and no `additionalProperties` says `additionalProperties: false`, unless it
    is combined with another schema that may add properties (it has applicators beside its
    properties; it is an anyOf / oneOf branch of a schema with object keywords of its own; it
    is a definition some such schema `$ref`s: `keep_open`). `here`: this node may be closed."""
    if isinstance(node, list):
        return [_prepared(item, how, here) for item in node]
    if not isinstance(node, dict):
        return node
    how.ids += _own_id(node)
    owns_objects = bool(_OBJECT_KEYS & node.keys())
    out = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            prefix = f"#/{key}/"
            out[key] = {
                name: _prepared(sub, how, prefix + name not in how.keep_open)
                for name, sub in value.items()
            }
        elif key in ("anyOf", "oneOf"):
            out[key] = _prepared(value, how, not owns_objects)
        else:
            out[key] = value if key in _DATA_KEYWORDS else _prepared(value, how)
    if how.close and here and _plain_all_of(node):
        out["allOf"] = _prepared(_closed_all_of(node), how, False)
    closes = how.close and here and not _APPLICATORS & node.keys()
    if closes and isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return _bounded(node, out, how)


def _bounded(node: dict, out: dict, how: _How) -> dict:
    """`out` with the bounds of a number without any: a `$ref` to the shared definition
    where the node is one numeric type with annotations only (llguidance builds a range's
    lexeme per occurrence, ~0.5 ms each; once per definition), else inline."""
    kind = node.get("type")
    if kind not in ("integer", "number") and not isinstance(kind, list):
        return out
    types = kind if isinstance(kind, list) else [kind]
    if not any(t in ("integer", "number") for t in types) or any(b in node for b in _BOUNDS):
        return out
    if (
        how.share
        and len(types) == 1
        and node.keys() - {"type"} <= _ANNOTATIONS
        and "multipleOf" not in node
    ):
        how.shared.add(_SHARED_NAMES[types[0]])
        return {
            "$ref": f"#/$defs/{_SHARED_NAMES[types[0]]}",
            **{k: v for k, v in out.items() if k != "type"},
        }
    out.update(minimum=-INTEGER_BOUND, maximum=INTEGER_BOUND)
    if "number" in types and "multipleOf" not in node:
        out["multipleOf"] = FRACTION_STEP
    return out


_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
_SHARED_NAMES = {"integer": "spruce_bounded_integer", "number": "spruce_bounded_number"}
_SHARED_NUMBERS = {
    _SHARED_NAMES["integer"]: {
        "type": "integer",
        "minimum": -INTEGER_BOUND,
        "maximum": INTEGER_BOUND,
    },
    _SHARED_NAMES["number"]: {
        "type": "number",
        "minimum": -INTEGER_BOUND,
        "maximum": INTEGER_BOUND,
        "multipleOf": FRACTION_STEP,
    },
}


def _refs_beside_object_keys(node: Any) -> set[str]:
    """The `$ref`s of schemas that also have object keywords, or that are anyOf / oneOf
    branches of such schemas (their targets take properties from beside them)."""
    found: set[str] = set()
    todo = [(node, False)]
    while todo:
        item, beside = todo.pop()
        if isinstance(item, list):
            todo += [(sub, beside) for sub in item]
            continue
        if not isinstance(item, dict):
            continue
        owns = bool(_OBJECT_KEYS & item.keys())
        if isinstance(item.get("$ref"), str) and (owns or beside):
            found.add(item["$ref"])
        for key, value in item.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                todo += [(sub, False) for sub in value.values()]
            elif key not in _DATA_KEYWORDS:
                todo.append((value, owns and key in ("anyOf", "oneOf")))
    return found
