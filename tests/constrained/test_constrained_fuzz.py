"""Random schemas over the supported keywords, random instances from hypothesis-jsonschema
and near misses of them, at the regex level:

- sound: every text the regex accepts is valid under the schema (jsonschema, formats
  asserted), unless lenient mode reported a keyword it breaks as not enforced;
- complete: every valid instance the regex can spell (see `_spellable`) is accepted when
  every keyword is enforced;
- honest: strict mode refuses exactly the schemas for which lenient mode reports keywords
  (naming one of them), and otherwise builds the same regex.
Derandomized: CI sees the same examples every run."""

from __future__ import annotations

import json
import re

import jsonschema
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import utils as conjecture_utils
from hypothesis_jsonschema import from_schema

from spruce.constrained import ConstraintError
from spruce.constrained.core.patterns import JSON_INTEGER, JSON_NUMBER
from spruce.constrained.report import violated_keywords
from spruce.constrained.schema.json_schema import canonical_instance, convert_schema
from spruce.constrained.schema.schema_context import SchemaOptions


def _more(self) -> bool:
    """hypothesis-jsonschema 0.23 draws objects with `many.more()`, which newer Hypothesis
    replaced by iteration inside `with many(...)`: the same loop, spelled the old way."""
    if not hasattr(self, "_compat_iter"):
        self.__enter__()
        self._compat_iter = iter(self)
    try:
        next(self._compat_iter)
        return True
    except StopIteration:
        self.__exit__(None)
        return False


if not hasattr(conjecture_utils.many, "more"):
    conjecture_utils.many.more = _more

NAMES = ["a", "b", "id", "x_1"]
PATTERNS = ["^[a-z]{1,4}$", "^x", "[0-9]$", "^(ab|cd)+$", "^[A-Z][a-z]*$"]
FORMATS = ["date", "uuid", "ipv4"]  # formats whose every valid string the regex spells
SMALL = st.integers(0, 3)
VALUES = st.one_of(
    st.integers(-3, 3), st.sampled_from(["x", "y", "", "ab"]), st.booleans(), st.none()
)
RECURSION_DEPTH = SchemaOptions().recursion_depth


def _with(base: dict, **optional) -> st.SearchStrategy:
    return st.fixed_dictionaries({k: st.just(v) for k, v in base.items()}, optional=optional)


STRINGS = _with(
    {"type": "string"}, minLength=SMALL, maxLength=st.integers(2, 6),
    pattern=st.sampled_from(PATTERNS), format=st.sampled_from(FORMATS),
)  # fmt: skip
INTEGERS = _with(
    {"type": "integer"}, minimum=st.integers(-20, 5), maximum=st.integers(0, 300),
    exclusiveMinimum=st.integers(-30, 0), multipleOf=st.integers(2, 7),
)  # fmt: skip
NUMBERS = _with({"type": "number"}, minimum=st.integers(-5, 0), maximum=st.integers(1, 50))
LITERALS = st.one_of(
    st.lists(VALUES, min_size=1, max_size=4, unique_by=json.dumps).map(lambda v: {"enum": v}),
    VALUES.map(lambda v: {"const": v}),
)
SCALARS = st.one_of(
    STRINGS, INTEGERS, NUMBERS, LITERALS, st.sampled_from([{"type": "boolean"}, {"type": "null"}])
)
NOT_FORMS = st.one_of(
    st.sampled_from(["string", "integer", "null", "boolean"]).map(lambda t: {"type": t}),
    st.lists(VALUES, min_size=1, max_size=2, unique_by=json.dumps).map(lambda v: {"enum": v}),
    st.integers(-2, 2).map(lambda n: {"type": "integer", "minimum": n}),
)


def _objects(children: st.SearchStrategy) -> st.SearchStrategy:
    @st.composite
    def build(draw) -> dict:
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
        schema = {"type": "object", "properties": {n: draw(children) for n in names}}
        schema["required"] = draw(
            st.lists(st.sampled_from(names), unique=True, max_size=len(names))
        )
        schema["additionalProperties"] = draw(
            st.one_of(st.just(False), st.just({"type": "integer"}))
        )
        if draw(st.booleans()):
            schema["maxProperties"] = draw(st.integers(1, 3))
        return schema

    return build()


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    pairs = st.lists(children, min_size=2, max_size=2)
    arrays = st.builds(lambda items, low, high: {"type": "array", "items": items, "minItems": low, "maxItems": low + high},
                       children, st.integers(0, 2), st.integers(0, 2))  # fmt: skip
    tuples = st.builds(
        lambda p, rest: {"type": "array", "prefixItems": p, "items": rest},
        pairs,
        st.sampled_from([False, {"type": "boolean"}]),
    )
    negated = st.builds(lambda s, n: {**s, "not": n}, children, NOT_FORMS)
    return st.one_of(
        _objects(children), arrays, tuples, negated,
        pairs.map(lambda p: {"anyOf": p}), pairs.map(lambda p: {"oneOf": p}), pairs.map(lambda p: {"allOf": p}),
    )  # fmt: skip


TREES = st.recursive(SCALARS, _extend, max_leaves=5)
RECURSIVE = TREES.map(
    lambda value: {
        "$defs": {"node": {
            "type": "object", "additionalProperties": False, "required": ["v"],
            "properties": {"v": value, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        }},
        "$ref": "#/$defs/node",
    }
)  # fmt: skip
SCHEMAS = st.one_of(TREES, TREES, RECURSIVE).map(
    lambda s: {"$schema": "https://json-schema.org/draft/2020-12/schema", **s}
)


def _unrolled(schema: dict, depth: int = 2) -> dict:
    """The recursive schema with its `$ref` written out `depth` times (hypothesis-jsonschema
    cannot draw from recursive references): a subset of its instances."""
    if "$defs" not in schema:
        return schema
    node = schema["$defs"]["node"]
    inner: dict = {"type": "null"}
    for _ in range(depth):
        inner = {
            "anyOf": [
                {**node, "properties": {**node["properties"], "next": inner}},
                {"type": "null"},
            ]
        }
    return {**node, "properties": {**node["properties"], "next": inner}}


def _convert(schema: dict, mode: str):
    try:
        return convert_schema(schema, SchemaOptions(mode=mode)), None
    except ConstraintError as e:
        return None, str(e)


def _spellable(value, depth: int = 0) -> bool:
    """Whether the regexes can write `value` as canonical compact JSON: printable ASCII
    strings without quotes or backslashes (patterns take unescaped characters only), numbers
    within the digit caps, recursion within the unrolled depth."""
    if isinstance(value, str):
        return re.fullmatch(r"[ !#-\[\]-~]*", value) is not None
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return re.fullmatch(JSON_INTEGER, str(value)) is not None
    if isinstance(value, float):  # bounded numbers are written without an exponent
        return re.fullmatch(JSON_NUMBER, json.dumps(value)) is not None and "e" not in json.dumps(
            value
        )
    if isinstance(value, list):
        return all(_spellable(v, depth) for v in value)
    return depth < RECURSION_DEPTH and all(
        _spellable(k) and _spellable(v, depth + 1) for k, v in value.items()
    )


def _near_misses(value) -> list:
    """Small edits of a valid instance: most are invalid, some are not."""
    if isinstance(value, bool) or value is None:
        return [not value if isinstance(value, bool) else 0, "null"]
    if isinstance(value, (int, float)):
        return [value + 1, value - 1, -value, value * 10, value + 0.5, str(value)]
    if isinstance(value, str):
        return [value + "a", value[:-1], value.upper() + "0", "", value * 3, 7]
    if isinstance(value, list):
        return [value + value[-1:], value[:-1], value + [None], [*value[1:], *value[:1]], {}]
    out = [{**value, k: None} for k in value] + [
        {k: v for k, v in value.items() if k != drop} for drop in value
    ]
    out += [{**value, "zz": 1}, {**value, "a": "x"}, []]
    return out + [{**value, k: m} for k, v in value.items() for m in _near_misses(v)[:2]]


@settings(
    max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(schema=SCHEMAS, data=st.data())
def test_random_schemas_are_sound_complete_and_honest(schema, data):
    lenient, error = _convert(schema, "lenient")
    if lenient is None:
        assert "allows no value" in error, error
        reject()
    strict, strict_error = _convert(schema, "strict")
    if lenient.unenforced:  # strict names one of them, or the size cap lenient mode relaxed
        named = (
            any(repr(k) in strict_error for k in lenient.unenforced) or "too large" in strict_error
        )
        assert strict is None and named, (lenient.unenforced, strict_error)
    else:
        assert strict is not None and strict.regex == lenient.regex, strict_error
    regex = re.compile(lenient.regex)
    unenforced = set(lenient.unenforced)
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    valid = from_schema(_unrolled(schema))
    instances = [data.draw(valid, label=f"valid instance {i}") for i in range(2)]
    for value in instances:
        text = canonical_instance(value, lenient.orders)
        if not unenforced and _spellable(value) and validator.is_valid(value):
            assert regex.fullmatch(text), f"valid and spellable, refused: {text}"
        for miss in _near_misses(value):
            miss_text = canonical_instance(miss, lenient.orders)
            if regex.fullmatch(miss_text) and not validator.is_valid(miss):
                broken = violated_keywords(schema, miss) or set()
                assert broken & unenforced, (
                    f"accepted {miss_text}, invalid ({sorted(broken)}), nothing reported"
                )
