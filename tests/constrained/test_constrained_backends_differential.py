"""Differential test of the grammar backends: for random small regexes and small JSON schemas,
"spruce", "llguidance" and "outlines" accept exactly the same strings, token by token (the
canonical tokenization and byte by byte), with the same can_end after every token. Candidate
strings come from each backend's own random walk, from hypothesis (`from_regex`) or a small
instance generator for the drawn schemas, and from one-byte mutations of those.

Known differences are excluded explicitly, never hidden (see KNOWN below)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_constrained_grammars import allowed_ids, byte_token_ids, mutate

from spruce.constrained import GrammarCompiler, make_spec

BACKENDS = ("spruce", "llguidance", "outlines")
EXAMPLES = 12
WALKS = 3  # random walks per backend per constraint

# Known differences, each excluded where it shows and nowhere else:
# - OUTLINES_PAST_AN_END: outlines-core 0.2.x drops, from a state where the regex may end,
#   every token that leads to a state where it may not (regex-automata reports a match one
#   byte late, and the Index keeps a token only if its end state is "not a match" or "a full
#   match"). So for `ab(cd)?` it refuses `c` after `ab`, for `[0-9]+(\.[0-9]+)?` the `.` after
#   `1`: it accepts a subset. Where outlines refuses a token the others take right after a
#   position where the constraint could end, the rest of that string is not compared for it.
# - The regex dialect: the drawn regexes use only what the three read alike (literals, small
#   classes, groups, |, ?, *, +, {m,n}); not \d, \w, \s (Unicode in Rust's regex, ASCII in
#   spruce's), nor anchors, lookarounds or backreferences.
# - JSON schemas: the drawn schemas have no free strings (outlines-core and spruce refuse
#   U+007F-U+009F and \\u escapes in strings, llguidance takes them), no number bounds
#   (outlines-core ignores minimum / maximum), no optional properties (outlines-core and
#   llguidance differ in which orders and separators they allow), compact output.
# - LONG_NUMBERS: spruce and llguidance write a JSON number with at most 16 integer digits
#   (patterns.MAX_DIGITS; llguidance's own limit agrees here), outlines-core any number: a
#   digit refused after a run of 16 digits is not compared for outlines.
OUTLINES_PAST_AN_END = "outlines-core drops tokens that continue past a possible end"
LONG_NUMBERS = "outlines-core takes integers of any length"
KNOWN = (OUTLINES_PAST_AN_END, LONG_NUMBERS)
MAX_DIGITS = 16


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer)
    yield compiler
    compiler.close()


# -- drawing constraints ------------------------------------------------------------------------

_ATOMS = st.sampled_from(["a", "b", "c", "ab", "0", "1", "[a-c]", "[0-9]", "[^a]", "x"])


def _combine(children):
    return st.one_of(
        st.tuples(children, children).map(lambda p: p[0] + p[1]),
        st.tuples(children, children).map(lambda p: f"({p[0]}|{p[1]})"),
        children.map(lambda r: f"({r})?"),
        children.map(lambda r: f"({r})*"),
        children.map(lambda r: f"({r})+"),
        st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
            lambda p: f"({p[0]}){{{min(p[1], p[2])},{max(p[1], p[2]) or 1}}}"
        ),
    )


REGEXES = st.recursive(_ATOMS, _combine, max_leaves=6)

_SCALARS = st.sampled_from([
    {"type": "integer"}, {"type": "boolean"}, {"type": "null"},
    {"enum": ["red", "green", 3]}, {"const": "k"},
    {"type": "string", "pattern": "^[a-z]{1,3}$"}, {"type": "string", "enum": ["a", "bc"]},
])  # fmt: skip


def _containers(children):
    names = st.lists(st.sampled_from(["a", "b", "id", "x_1"]), min_size=1, max_size=2, unique=True)
    return st.one_of(
        st.tuples(names, st.lists(children, min_size=2, max_size=2)).map(
            lambda p: {"type": "object", "properties": dict(zip(p[0], p[1])), "required": p[0]}
        ),
        st.tuples(children, st.integers(0, 2), st.integers(0, 1)).map(
            lambda p: {"type": "array", "items": p[0], "minItems": p[1], "maxItems": p[1] + p[2]}
        ),
    )


SCHEMAS = st.recursive(_SCALARS, _containers, max_leaves=4)


def _instance(schema: dict, rng: random.Random):
    """A random valid instance of a drawn schema (the few keywords above)."""
    if "enum" in schema or "const" in schema:
        return rng.choice(schema.get("enum", [schema.get("const")]))
    kind = schema["type"]
    if kind == "object":
        return {name: _instance(sub, rng) for name, sub in schema["properties"].items()}
    if kind == "array":
        return [
            _instance(schema["items"], rng)
            for _ in range(rng.randint(schema["minItems"], schema["maxItems"]))
        ]
    if kind == "string":
        return "".join(rng.choice("abcxyz") for _ in range(rng.randint(1, 3)))
    return {
        "integer": lambda: rng.randint(-50, 50),
        "boolean": lambda: rng.random() < 0.5,
        "null": lambda: None,
    }[kind]()


# -- comparing ------------------------------------------------------------------------------------


def _grammars(compiler, **constraint) -> dict:
    return {name: compiler.compile(make_spec(**constraint, backend=name)) for name in BACKENDS}


def _walk(grammar, rng: random.Random, cap: int = 40) -> bytes:
    """A random walk over the grammar's mask (EOS not taken), stopped at random where it may
    end or at the cap."""
    vocab, cursor, out = grammar.vocab, grammar.cursor(), b""
    for _ in range(cap):
        choices = [t for t in allowed_ids(cursor, vocab) if t not in vocab.eos_token_ids]
        if not choices or (cursor.can_end() and rng.random() < 0.3):
            break
        token = rng.choice(choices)
        assert cursor.accept_token(token)
        out += vocab.token_bytes[token]
    return out


def _trace(grammar, token_ids: list[int]) -> list[tuple[bool, bool]]:
    """(accepted, can_end) after each token, up to the first refused one."""
    cursor, trace = grammar.cursor(), [(True, grammar.cursor().can_end())]
    for token in token_ids:
        accepted = cursor.accept_token(token)
        trace.append((accepted, cursor.can_end() if accepted else False))
        if not accepted:
            break
    return trace


def _compare(grammars: dict, token_ids: list[int], what: str, known: list[str]) -> None:
    """Every backend's trace equals spruce's, but for the KNOWN differences (recorded)."""
    traces = {name: _trace(grammar, token_ids) for name, grammar in grammars.items()}
    reference = traces["spruce"]
    assert traces["llguidance"] == reference, (
        f"{what}: spruce {reference} vs llguidance {traces['llguidance']}"
    )
    outlines = traces["outlines"]
    if outlines == reference:
        return
    step = next(i for i, (a, b) in enumerate(zip(outlines, reference)) if a != b)
    if step > 0 and reference[step - 1][1] and not outlines[step][0]:
        known.append(OUTLINES_PAST_AN_END)  # refused right after a possible end: see KNOWN
        return
    vocab = grammars["spruce"].vocab
    prefix = b"".join(vocab.token_bytes[t] for t in token_ids[:step])
    run = len(prefix) - len(prefix.rstrip(b"0123456789"))
    if not reference[step][0] and outlines[step][0] and run > MAX_DIGITS:
        known.append(LONG_NUMBERS)  # refused past the digit limit: see KNOWN
        return
    raise AssertionError(f"{what}: spruce {reference} vs outlines {outlines}")


def _check_candidates(
    grammars: dict, tokenizer, candidates: list[bytes], rng: random.Random
) -> list[str]:
    byte_ids, known = byte_token_ids(grammars["spruce"].vocab), []
    for data in candidates + [mutate(c, rng) for c in candidates]:
        _compare(grammars, [byte_ids[b] for b in data], f"bytes {data!r}", known)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            continue
        _compare(
            grammars, tokenizer.encode(text, add_special_tokens=False), f"tokens of {text!r}", known
        )
    return known


def _walks(grammars: dict, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [_walk(grammar, rng) for grammar in grammars.values() for _ in range(WALKS)]


_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip


@_SETTINGS
@given(regex=REGEXES, data=st.data())
def test_backends_accept_the_same_strings_for_random_regexes(compiler, tiny_tokenizer, regex, data):
    grammars = _grammars(compiler, regex=regex)
    drawn = [
        data.draw(st.from_regex(regex, fullmatch=True).filter(lambda s: len(s) < 20)).encode()
        for _ in range(3)
    ]
    known = _check_candidates(
        grammars, tiny_tokenizer, drawn + _walks(grammars, len(regex)), random.Random(regex)
    )
    assert set(known) <= set(KNOWN)


@_SETTINGS
@given(schema=SCHEMAS)
def test_backends_accept_the_same_instances_for_small_schemas(compiler, tiny_tokenizer, schema):
    grammars = _grammars(compiler, json_schema=schema)
    key = json.dumps(schema, sort_keys=True)
    rng = random.Random(key)
    drawn = [json.dumps(_instance(schema, rng), separators=(",", ":")).encode() for _ in range(3)]
    known = _check_candidates(grammars, tiny_tokenizer, drawn + _walks(grammars, len(key)), rng)
    assert set(known) <= set(KNOWN)


def test_the_outlines_difference_is_real_and_only_past_an_end(compiler, tiny_tokenizer):
    """The one known difference, pinned: outlines refuses `c` after `ab` for `ab(cd)?`
    (strict: this fails once outlines-core fixes it, and KNOWN can shrink)."""
    grammars = _grammars(compiler, regex="ab(cd)?")
    ids = [byte_token_ids(grammars["spruce"].vocab)[b] for b in b"abcd"]
    assert _trace(grammars["spruce"], ids) == _trace(grammars["llguidance"], ids)
    assert _trace(grammars["spruce"], ids)[-1] == (True, True)
    assert _trace(grammars["outlines"], ids) == [
        (True, False),
        (True, False),
        (True, True),
        (False, False),
    ]
