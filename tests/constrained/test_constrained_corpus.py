"""Real-world schemas (a SchemaStore subset with its published examples, Apache-2.0, and
schemas of kinds it lacks) at the regex level, and a few at the token level: compact JSON
with keys in the grammar's order (`canonical_instance`), lenient mode."""

from __future__ import annotations

import json
import re

import pytest
from support import DATA_DIR
from spruce.constrained import ConstraintError, make_spec
from spruce.constrained.json_schema import canonical_instance, convert_schema
from spruce.constrained.schema_context import SchemaOptions
from test_constrained_helpers import tiny_compiler  # noqa: F401  (a fixture)

CORPUS = sorted((DATA_DIR / "schemastore").glob("*.json")) + sorted((DATA_DIR / "schemas_kinds").glob("*.json"))
MIN_PASSING = 80  # measured 85 of 150 (default options: objects closed, size caps on)


def _load(path) -> dict:
    return json.loads(path.read_text())


def _check(entry: dict, options: SchemaOptions) -> tuple[bool, list[str]]:
    """(every valid example accepted and every invalid one refused, invalid ones accepted
    although nothing is reported unenforced)."""
    try:
        converted = convert_schema(entry["schema"], options)
    except ConstraintError:  # refused (over a size cap): not passed
        return False, []
    regex = re.compile(converted.regex)
    texts = lambda kind: [canonical_instance(v, converted.orders) for v in entry[kind]]
    accepted_invalid = [t for t in texts("invalid") if regex.fullmatch(t)]
    passed = all(regex.fullmatch(t) for t in texts("valid")) and not accepted_invalid
    return passed, [] if converted.unenforced else accepted_invalid


def test_corpus_pass_rate_and_no_invalid_accepted_where_enforced():
    options = SchemaOptions()
    passed, wrong = 0, {}
    for path in CORPUS:
        ok, accepted_invalid = _check(_load(path), options)
        passed += ok
        if accepted_invalid:
            wrong[path.stem] = accepted_invalid
    assert not wrong, f"invalid examples accepted with every keyword enforced: {wrong}"
    print(f"{passed} of {len(CORPUS)} pass")
    assert passed >= MIN_PASSING, f"{passed} of {len(CORPUS)} schemas pass"


def test_the_written_kinds_pass_exactly():
    for path in sorted((DATA_DIR / "schemas_kinds").glob("*.json")):
        ok, _ = _check(_load(path), SchemaOptions())
        assert ok, path.stem


TOKEN_LEVEL = [p for p in CORPUS if p.parent.name == "schemas_kinds"] + CORPUS[:: len(CORPUS) // 8]


@pytest.mark.parametrize("path", TOKEN_LEVEL, ids=lambda p: p.stem)
def test_valid_examples_walk_through_the_token_index(tiny_compiler, tiny_tokenizer, path):  # noqa: F811
    entry = _load(path)
    try:
        spec = make_spec(json_schema=entry["schema"])
    except ConstraintError:
        pytest.skip("refused at the regex level (over a size cap)")
    converted = convert_schema(entry["schema"])
    grammar = tiny_compiler.compile(spec)
    for value in entry["valid"]:
        text = canonical_instance(value, converted.orders)
        if not re.fullmatch(spec.regex, text):
            continue  # refused at the regex level already (counted by the pass-rate test)
        state = grammar.initial_state
        for token in tiny_tokenizer.encode(text, add_special_tokens=False):
            state = grammar.next_state(state, token)
            assert state is not None, f"{path.stem}: token {token} refused in {text[:80]}"
        assert grammar.is_final(state)
