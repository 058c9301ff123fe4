"""How large a schema's regex is, part by part: the schema paths that make it large (named in
the size error) and, in lenient mode, the relaxations that bring it under the cap.

Each `RegexBuilder.value` call records a `Part` (its schema path, its regex, the parts built
inside it; a part built once and reused, such as a `$ref` target, is one shared object). A
part's weight is its own positions (its regex's `regex_size` less its children's) times the
number of copies of it in the whole regex. Relaxing a path drops, level by level, what costs
there: BOUNDS (maxLength / minLength, maxItems / minItems, min/maxProperties), CONTENT
(pattern, format), then LOOSE: any value of the types the subschema allows, every keyword
below it reported unenforced. The finished output is validated against the full schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spruce.constrained.automaton.limits import MAX_EXPANDED_SIZE, regex_size
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.schema.schema_context import LOOSE, Context
from spruce.constrained.schema.schema_refs import resolve_ref

MAX_RELAX_ROUNDS = 8  # each round converts the schema again
TARGET_SIZE = MAX_EXPANDED_SIZE * 3 // 4  # relax towards this: part sizes are estimates
LOOSE_MIN = 700  # a LOOSE object or array costs about this much: only larger parts are loosened
_SHOWN = 3  # paths named in the size error
KEYWORDS = frozenset({
    "type", "enum", "const", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "items", "prefixItems", "additionalItems",
    "minItems", "maxItems", "properties", "patternProperties", "additionalProperties", "required",
    "propertyNames", "minProperties", "maxProperties", "allOf", "anyOf", "oneOf", "not", "if",
    "dependencies", "dependentRequired", "dependentSchemas", "$ref",
})  # fmt: skip


@dataclass(eq=False)
class Part:
    """One `RegexBuilder.value` call: a subschema's path, its regex, the parts inside it."""

    path: str
    regex: str | None = None
    children: list[Part] = field(default_factory=list)


def heaviest(root: Part) -> list[tuple[int, Part]]:
    """(weight, part) for every distinct part, heaviest first (see the module docstring)."""
    weights = [(own * copies, part) for part, _, own, copies in _measured(root)]
    return sorted(weights, key=lambda wp: -wp[0])


def _measured(root: Part) -> list[tuple[Part, int, int, int]]:
    """(part, size, own size, copies) for every distinct part, parents first."""
    parts = _topological(root)
    sizes: dict[int, int] = {}
    size = lambda p: sizes.setdefault(id(p.regex), regex_size(p.regex or ""))  # noqa: E731
    copies = {id(root): 1}
    for part in parts:
        for child in part.children:
            copies[id(child)] = copies.get(id(child), 0) + copies[id(part)]
    out = []
    for part in parts:
        own = max(size(part) - sum(size(child) for child in part.children), 0)
        out.append((part, size(part), own, copies[id(part)]))
    return out


def _topological(root: Part) -> list[Part]:
    """Parents before children (a part used in several places comes after all its users)."""
    order, seen = [], set()

    def visit(part: Part) -> None:
        seen.add(id(part))
        for child in part.children:
            if id(child) not in seen:
                visit(child)
        order.append(part)

    visit(root)
    return order[::-1]


def relax(root: Part, size: int, ctx: Context, relaxed: dict[str, int]) -> bool:
    """One round: the heaviest paths, until their weight covers the excess over TARGET_SIZE,
    drop their bounds, or their patterns and formats, or (a part with neither that is larger
    than any value) become LOOSE; then, if that was not enough, the smallest subtrees that
    cover the excess become LOOSE. False when nothing is left to relax."""
    excess, covered, loosened = size - TARGET_SIZE, 0, []
    for part, total, own, copies in sorted(_measured(root)[1:], key=lambda m: -m[2] * m[3]):
        if own * copies == 0 or covered >= excess:
            break
        if any(part.path.startswith(path + "/") for path in loosened):
            continue  # inside a subtree loosened this round
        current = relaxed.get(part.path, 0)
        levels = sorted(level for level in ctx.relaxable.get(part.path, ()) if level > current)
        if levels:
            relaxed[part.path] = levels[0]
            covered += own * copies
        elif current < LOOSE and total > LOOSE_MIN:
            relaxed[part.path] = LOOSE
            loosened.append(part.path)
            covered += (total - LOOSE_MIN) * copies
    return covered > 0 or _loosen(root, excess, relaxed)


def _loosen(root: Part, excess: int, relaxed: dict[str, int]) -> bool:
    """LOOSE for the smallest subtree (all its copies) larger than the excess, else for the
    largest subtrees that do not nest, until they cover it; the root last."""
    measured = [
        (size * copies, part) for part, size, _, copies in _measured(root)[1:]
        if relaxed.get(part.path, 0) < LOOSE and size > LOOSE_MIN
    ]  # fmt: skip
    enough = [(total, part) for total, part in measured if total > excess]
    if enough:
        relaxed[min(enough, key=lambda tp: tp[0])[1].path] = LOOSE
        return True
    chosen, covered = set(), 0
    for total, part in sorted(measured, key=lambda tp: -tp[0]):
        if covered >= excess:
            break
        if not any(part.path.startswith(path + "/") for path in chosen):
            chosen.add(part.path)
            covered += total
    for path in chosen:
        relaxed[path] = LOOSE
    if not chosen and relaxed.get(root.path, 0) < LOOSE:
        relaxed[root.path] = LOOSE
        return True
    return bool(chosen)


def relax_overflow(root: Part, relaxed: dict[str, int]) -> bool:
    """The regex text ran past its cap while building (`root` holds the parts built so far):
    the heaviest built parts, half the weight, become LOOSE. False when nothing is left."""
    weights = [(w, p) for w, p in heaviest(root) if w and relaxed.get(p.path, 0) < LOOSE]
    half, covered = sum(w for w, _ in weights) / 2, 0
    for weight, part in weights:
        if covered >= half:
            break
        relaxed[part.path] = LOOSE
        covered += weight
    return bool(weights)


def too_large_message(root: Part, size: int) -> str:
    """The size error, naming the schema paths that weigh most."""
    shown = [f"{part.path} ({weight})" for weight, part in heaviest(root)[:_SHOWN] if weight]
    return (
        f"schema too large: its regex expands to about {size} positions (cap {MAX_EXPANDED_SIZE}); "
        f"the largest parts (schema path, positions): {', '.join(shown)}. Lower their maxLength / "
        "maxItems / enum sizes, or use schema_mode 'lenient', which relaxes them and validates "
        "the output"
    )


def subtree_keywords(schema: Any, path: str, ctx: Context) -> set[str]:
    """The validation keywords used below `schema` and in it (local `$ref`s followed), but
    its own `type`, which a LOOSE relaxation keeps."""
    found: set[str] = set()
    seen: set[int] = set()
    todo = [schema]
    while todo:
        node = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        found.update(k for k in node if k in KEYWORDS and not (node is schema and k == "type"))
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                todo.extend(value.values())
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                todo.extend(value)
            elif key in _SCHEMA_VALUES:
                todo.append(value)
        if "$ref" in node:
            todo.append(_target(node["$ref"], path, ctx))
    return found - {"$ref"}


_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "dependencies")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties", "propertyNames", "not", "if",
                  "then", "else", "contains")  # fmt: skip


def _target(ref: Any, path: str, ctx: Context) -> Any:
    try:
        return resolve_ref(ref, path, ctx)
    except ConstraintError:
        return None
