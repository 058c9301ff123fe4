"""Real-world schemas (a SchemaStore subset with its published examples, Apache-2.0, and
schemas of kinds it lacks) at the regex level, and a few at the token level: compact JSON
with keys in the grammar's order (`canonical_instance`), lenient mode. Each schema is
converted once per session (`_converted`), whichever test asks first."""

from __future__ import annotations

import functools
import json
import re

import pytest
from support import DATA_DIR
from test_constrained_helpers import tiny_compiler  # noqa: F401  (a fixture)

from spruce.constrained import ConstraintError, unpack_bitmask
from spruce.constrained.report import excused
from spruce.constrained.schema.json_schema import SchemaRegex, canonical_instance, convert_schema
from spruce.constrained.spec import JSON_SCHEMA, ConstraintSpec

CORPUS = sorted((DATA_DIR / "schemastore").glob("*.json")) + sorted(
    (DATA_DIR / "schemas_kinds").glob("*.json")
)
MIN_PASSING = 126  # measured 130 of 150 (default options: objects closed, oversized parts relaxed)


@functools.cache
def _load(path) -> dict:
    return json.loads(path.read_text())


@functools.cache
def _converted(path) -> SchemaRegex | None:
    """Lenient mode, default options; None when refused."""
    try:
        return convert_schema(_load(path)["schema"])
    except ConstraintError:
        return None


def _check(path) -> tuple[bool, list[str]]:
    """(every valid example accepted and every invalid one refused, the invalid ones
    accepted that break no keyword reported unenforced)."""
    entry, converted = _load(path), _converted(path)
    if converted is None:
        return False, []
    regex = re.compile(converted.regex)
    accepted = [
        v for v in entry["invalid"] if regex.fullmatch(canonical_instance(v, converted.orders))
    ]
    unexcused = [
        canonical_instance(v, converted.orders) for v in accepted
        if not excused(entry["schema"], v, converted.unenforced)
    ]  # fmt: skip
    passed = (
        all(regex.fullmatch(canonical_instance(v, converted.orders)) for v in entry["valid"])
        and not accepted
    )
    return passed, unexcused


def test_corpus_pass_rate_and_no_invalid_accepted_where_enforced():
    passed, wrong = 0, {}
    for path in CORPUS:
        ok, unexcused = _check(path)
        passed += ok
        if unexcused:
            wrong[path.stem] = unexcused
    assert not wrong, f"invalid examples accepted that break only enforced keywords: {wrong}"
    print(f"{passed} of {len(CORPUS)} pass")
    assert passed >= MIN_PASSING, f"{passed} of {len(CORPUS)} schemas pass"


def test_the_written_kinds_pass_exactly():
    for path in sorted((DATA_DIR / "schemas_kinds").glob("*.json")):
        ok, _ = _check(path)
        assert ok, path.stem


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_valid_examples_walk_through_the_grammar_token_by_token(
    tiny_compiler, tiny_tokenizer, path
):
    """Every valid example the regex accepts, tokenized: each token is in its state's mask and
    the grammar accepts at the end."""
    converted = _converted(path)
    if converted is None:
        pytest.skip("refused at the regex level")
    spec = ConstraintSpec(
        JSON_SCHEMA,
        json.dumps(_load(path)["schema"]),
        converted.regex,
        unenforced=converted.unenforced,
    )
    grammar = tiny_compiler.compile(spec)
    for value in _load(path)["valid"]:
        text = canonical_instance(value, converted.orders)
        if not re.fullmatch(converted.regex, text):
            continue  # refused at the regex level already (counted by the pass-rate test)
        state = grammar.initial_state
        for token in tiny_tokenizer.encode(text, add_special_tokens=False):
            assert unpack_bitmask(grammar.mask(state)[None], tiny_compiler.vocab_size)[0, token]
            state = grammar.next_state(state, token)
            assert state is not None, f"{path.stem}: token {token} refused in {text[:80]}"
        assert grammar.is_final(state)
