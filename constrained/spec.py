"""Constraint specs: what a request asks for, validated before anything is compiled."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

from spruce.constrained import backends
from spruce.constrained.automaton.byte_nfa import parse_regex
from spruce.constrained.automaton.limits import check_regex_size
from spruce.constrained.backends import GRAMMAR_KINDS
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.core.patterns import DTYPE_REGEXES, choices_regex, strip_anchors
from spruce.constrained.schema.json_schema import convert_schema, load_schema
from spruce.constrained.schema.schema_context import LENIENT, SchemaOptions
from spruce.constrained.schema.schema_validator import check_root_ids

REGEX, JSON_SCHEMA = "regex", "json_schema"
EBNF, LARK, STRUCTURAL_TAG = GRAMMAR_KINDS


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """`kind` is "regex" (value: the regex; choices and dtypes become regexes), "json_schema"
    (value: the schema as JSON text, property order kept), "ebnf" or "lark" (value: the
    grammar text) or "structural_tag" (value: the tag as JSON text).
    `backend`: the grammar backend that compiles it (backends/: spruce, llguidance,
    outlines); `regex`: the constraint as a regex where the backend works from one ("" for
    llguidance); `grammar`: the backend's own form (llguidance's grammar text; "" for the
    others); both converted once by `make_spec` and carried from then on.
    `variant`: the conversion options that differ from the defaults (they change the regex).
    `unenforced`: the schema keywords the regex does not enforce (lenient mode): the output
    is validated against the schema once finished (see `schema_report`).
    `fallback`: set on a JSON schema that auto gives llguidance in lenient mode without its
    check at the front door (building the grammar checks it, and a check alone costs as
    much as the build): the schema options the spruce converter takes it with if llguidance
    refuses it when compiled. The compiled grammar's spec is the decided one (backend,
    `unenforced` from llguidance's warnings, no `fallback`); None once decided.
    Hashable on (kind, value, variant, backend): the compiled-grammar cache key."""

    kind: str
    value: str
    regex: str = field(compare=False)
    variant: str = ""
    unenforced: tuple[str, ...] = field(default=(), compare=False)
    backend: str = "spruce"
    grammar: str = field(default="", compare=False)
    fallback: dict[str, Any] | None = field(default=None, compare=False)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "value": self.value, "regex": self.regex, "variant": self.variant,
            "unenforced": list(self.unenforced), "backend": self.backend, "grammar": self.grammar,
            "fallback": self.fallback,
        }  # fmt: skip


def too_many_constraints(given: Sequence[str]) -> str:
    """The one message for a request that sets several constraints (every API and the DSL
    use it; `given`: the names the caller gave them by)."""
    return f"give at most one constraint; got {', '.join(given)}"


def make_spec(
    regex: str | None = None,
    json_schema: Any = None,
    choices: list[str] | tuple[str, ...] | None = None,
    dtype: type | str | None = None,
    whitespace_pattern: str = "",
    schema_mode: str = LENIENT,
    schema_options: SchemaOptions | None = None,
    *,
    ebnf: str | None = None,
    lark: str | None = None,
    structural_tag: Any = None,
    backend: str = "auto",
    check: bool = False,
) -> ConstraintSpec | None:
    """Validates a constraint (at most one) and returns its spec, or None when none is
    given. Raises ConstraintError for anything invalid or unsupported.

    json_schema: a dict, a JSON string or a pydantic model class. choices: the output is one
    of the strings. dtype: int, float, bool, str (or their names): see DTYPE_REGEXES.
    ebnf: a GBNF grammar (llama.cpp's dialect; root rule `root`). lark: a grammar in
    llguidance's Lark dialect (start rule `start`). structural_tag: a dict or its JSON text
    (structural_tag.py). backend: auto | spruce | llguidance | outlines (backends/).
    whitespace_pattern: the whitespace a JSON schema's output may hold between tokens.
    schema_mode: "lenient" (default: a keyword that cannot be enforced is left out of the
    grammar and listed in `unenforced`) or "strict" (refused, naming it).
    schema_options: recursion_depth, any_json_depth, property order (see SchemaOptions);
    its mode and whitespace_pattern are replaced by the two arguments above.
    check: decide the backend of a JSON schema here even where auto could leave llguidance's
    check to the compile (`ConstraintSpec.fallback`): for a spec embedded in a larger grammar."""
    candidates = {
        "regex": regex, "json_schema": json_schema, "choices": choices, "dtype": dtype,
        EBNF: ebnf, LARK: lark, STRUCTURAL_TAG: structural_tag,
    }  # fmt: skip
    given = [name for name, value in candidates.items() if value is not None]
    if len(given) > 1:
        raise ConstraintError(too_many_constraints(given))
    if not given:
        return None
    name = given[0]
    if name == "json_schema":
        options = replace(
            schema_options or SchemaOptions(),
            mode=schema_mode,
            whitespace_pattern=whitespace_pattern,
        )
        return _schema_spec(json_schema, options, backend, check)
    if name in GRAMMAR_KINDS:
        return _grammar_spec(name, candidates[name], backend)
    if name == "choices":
        regex = choices_regex(_checked_choices(choices))
    elif name == "dtype":
        regex = DTYPE_REGEXES[_dtype_name(dtype)]
    return _regex_spec(regex, backend)


def _schema_spec(
    json_schema: Any, options: SchemaOptions, backend: str, check: bool
) -> ConstraintSpec:
    """The first backend that takes the schema (in lenient mode, leaving out what it cannot
    enforce: `unenforced`, checked on the finished output); one that refuses it passes it on.
    Unless `check`, llguidance's check of a lenient schema with a backend after it is left to
    the compile (`ConstraintSpec.fallback`)."""
    schema = load_schema(json_schema)
    check_root_ids(schema)  # the finished output is validated against it (report.py)
    text = json.dumps(schema, ensure_ascii=False)
    tried = backends.candidates(JSON_SCHEMA, backend)
    for name in tried:
        if name == "spruce":
            converted = convert_schema(schema, options)  # every check, before any compute
            return ConstraintSpec(
                JSON_SCHEMA, text, converted.regex, _variant(options), converted.unenforced
            )
        defer = not check and options.mode == LENIENT and name == "llguidance" and name != tried[-1]
        try:
            made = _backend_schema(
                name, schema, options, lenient=options.mode == LENIENT, check=not defer
            )
        except ConstraintError:
            if name == tried[-1]:
                raise
            continue
        fallback = asdict(options) if defer else None
        return ConstraintSpec(
            JSON_SCHEMA,
            text,
            made.regex,
            _variant(options),
            made.unenforced,
            name,
            made.grammar,
            fallback,
        )
    raise AssertionError("the last backend raises or returns")


class _Made(NamedTuple):
    regex: str
    grammar: str
    unenforced: tuple[str, ...]


def _backend_schema(
    name: str, schema: Any, options: SchemaOptions, lenient: bool, check: bool
) -> _Made:
    if name == "llguidance":
        from spruce.constrained.backends.llguidance_text import schema_grammar

        return _Made("", *schema_grammar(schema, options, lenient, check))
    regex = backends.module(name).schema_regex(schema, options)  # outlines: its own converter
    if regex is None:
        raise ConstraintError(
            f"the {name} grammar backend cannot enforce this json_schema (try --grammar-backend auto)"
        )
    return _Made(regex, "", ())


def _grammar_spec(kind: str, value: Any, backend: str) -> ConstraintSpec:
    backends.candidates(kind, backend)  # llguidance, or a ConstraintError naming the backend
    from spruce.constrained.backends import llguidance_text
    from spruce.constrained.backends.lark_repeats import check_repeats

    if kind == STRUCTURAL_TAG:
        from spruce.constrained.backends.structural_tag import structural_tag_to_lark

        lark = structural_tag_to_lark(value)  # a dict or its JSON text; errors name the field
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        grammar = llguidance_text.lark_grammar(lark, STRUCTURAL_TAG)
        check_repeats(grammar, STRUCTURAL_TAG)
        return ConstraintSpec(kind, text, "", backend="llguidance", grammar=grammar)
    if not isinstance(value, str):
        raise ConstraintError(f"{kind} must be a grammar text (a string)")
    grammar = (
        llguidance_text.ebnf_grammar(value) if kind == EBNF else llguidance_text.lark_grammar(value)
    )
    check_repeats(grammar, kind)  # llguidance's lexer would take them, then fail on a token
    return ConstraintSpec(kind, value, "", backend="llguidance", grammar=grammar)


def _variant(options: SchemaOptions) -> str:
    """The options that change the regex, where they differ from the defaults."""
    default = SchemaOptions()
    names = (
        "recursion_depth",
        "any_json_depth",
        "property_order",
        "any_order_max",
        "open_objects",
        "whitespace_pattern",
    )
    return ",".join(
        f"{n}={getattr(options, n)!r}" for n in names if getattr(options, n) != getattr(default, n)
    )


def _regex_spec(regex: Any, backend: str) -> ConstraintSpec:
    if not isinstance(regex, str):
        raise ConstraintError(f"regex must be a string; got {type(regex).__name__}")
    regex = strip_anchors(regex)
    check_regex_size(regex, parse_regex(regex))
    name = backends.candidates(REGEX, backend)[0]
    if name == "llguidance":
        from spruce.constrained.backends.llguidance_text import regex_grammar

        return ConstraintSpec(REGEX, regex, regex, backend=name, grammar=regex_grammar(regex))
    return ConstraintSpec(REGEX, regex, regex, backend=name)


def _checked_choices(choices: Any) -> list[str]:
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
        raise ConstraintError("choices must be a list of strings")
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ConstraintError("choices must be a non-empty list of strings")
    return list(choices)


def _dtype_name(dtype: Any) -> str:
    name = dtype.__name__ if isinstance(dtype, type) else dtype
    if name not in DTYPE_REGEXES:
        raise ConstraintError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_REGEXES)}")
    return name
