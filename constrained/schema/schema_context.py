"""Options of the JSON schema conversion and the record of what it could not enforce."""

from __future__ import annotations

from dataclasses import dataclass, field

from spruce.constrained.core.errors import ConstraintError

STRICT, LENIENT = "strict", "lenient"
SCHEMA_MODES = (STRICT, LENIENT)
PROPERTY_ORDERS = ("definition", "required_first")


@dataclass(frozen=True, slots=True)
class SchemaOptions:
    """mode: "strict" refuses a schema with a keyword that cannot be enforced (naming it);
    "lenient" builds the grammar without it and lists it in `SchemaRegex.unenforced` (the
    runtime then validates the output with `jsonschema`).
    recursion_depth: how many times one `$ref` may nest in itself (recursive schemas are
    unrolled; the deepest level is closed off: an optional recursive part is left out).
    any_json_depth: how deep containers nest in a value the schema leaves free (`{}`).
    property_order: "definition" (the schema's order) or "required_first".
    any_order_max: objects with at most this many properties accept them in any order
    (a permutation regex: n! orders; 0 keeps one order).
    open_objects: whether an object that declares properties but says nothing of
    additionalProperties takes extra ones (the specification: yes; the default keeps the
    output to the declared properties, as outlines-core and XGrammar do: extra keys cost a
    free-value regex per object and invite the model to invent fields)."""

    mode: str = LENIENT
    recursion_depth: int = 4
    any_json_depth: int = 2
    property_order: str = "definition"
    any_order_max: int = 0
    open_objects: bool = False
    whitespace_pattern: str = ""

    def __post_init__(self) -> None:
        if self.mode not in SCHEMA_MODES:
            raise ConstraintError(
                f"schema_mode must be one of {', '.join(SCHEMA_MODES)}; got {self.mode!r}"
            )
        if self.property_order not in PROPERTY_ORDERS:
            raise ConstraintError(
                f"property_order must be one of {', '.join(PROPERTY_ORDERS)}; got {self.property_order!r}"
            )
        for name in ("recursion_depth", "any_json_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 8:
                raise ConstraintError(f"{name} must be an integer in [0, 8]; got {value!r}")
        if not isinstance(self.any_order_max, int) or not 0 <= self.any_order_max <= 5:
            raise ConstraintError(
                f"any_order_max must be an integer in [0, 5]; got {self.any_order_max!r}"
            )


@dataclass(slots=True)
class Unenforced:
    """Keyword -> the schema paths where it is not enforced (lenient mode)."""

    places: dict[str, list[str]] = field(default_factory=dict)

    def add(self, keyword: str, path: str) -> None:
        paths = self.places.setdefault(keyword, [])
        if path not in paths:
            paths.append(path)

    def keywords(self) -> tuple[str, ...]:
        return tuple(sorted(self.places))


# Relaxation levels (lenient mode, a regex over the size cap): what is dropped at a schema path.
BOUNDS, CONTENT, LOOSE = 1, 2, 3  # counts and lengths; patterns, formats, ranges; the subtree


class Context:
    """Per conversion: the options, the root schema, what was left unenforced, and the
    relaxations asked for (schema path -> level: BOUNDS, CONTENT or LOOSE, see
    `schema_size`); `relaxable` records, per path, the levels that would change its regex."""

    def __init__(
        self, root: object, options: SchemaOptions, relaxed: dict[str, int] | None = None
    ) -> None:
        self.root = root
        self.options = options
        self.unenforced = Unenforced()
        self.anchors: dict | None = None  # `$anchor` name -> schema, collected on first use
        self.relaxed = relaxed or {}
        self.relaxable: dict[str, set[int]] = {}

    def skip(self, keyword: str, path: str, why: str) -> None:
        """A keyword that cannot be enforced: refused (strict) or recorded (lenient)."""
        if self.options.mode == STRICT:
            raise ConstraintError(
                f"{keyword!r} at {path} cannot be enforced: {why} (schema_mode 'lenient' builds "
                f"the grammar without it and validates the output)"
            )
        self.unenforced.add(keyword, path)

    def keeps(self, level: int, path: str, keyword: str) -> bool:
        """Whether `keyword` at `path`, which relaxation `level` drops, is kept; recorded as
        unenforced when it is not."""
        self.relaxable.setdefault(path, set()).add(level)
        if self.relaxed.get(path, 0) < level:
            return True
        self.skip(keyword, path, "relaxed: the regex was over the size cap")
        return False
