"""Lenient mode end to end on the tiny random model: what the grammar cannot enforce is
reported in meta_info with whether the output validated; strict mode refuses it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from spruce.runtime import ConstraintError, InvalidRequestError
from spruce.runtime.engine.offline import Engine

UNIQUE_TAGS = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"enum": ["a", "b"]},
            "minItems": 2,
            "maxItems": 3,
            "uniqueItems": True,
        }
    },
    "required": ["tags"],
}
EXACT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "multipleOf": 5, "minimum": -50, "maximum": 1000}},
    "required": ["n"],
}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(str(tiny_llama_dir), kv_memory_gb=0.02, num_threads=1)


def test_lenient_outputs_carry_the_report(engine):
    validator = jsonschema.Draft202012Validator(UNIQUE_TAGS)
    seen = set()
    for seed in range(6):
        out = engine.generate(
            "x",
            {"temperature": 1.0, "max_new_tokens": 200, "seed": seed, "json_schema": UNIQUE_TAGS},
        )
        report = out["meta_info"]["json_schema"]
        assert report["unenforced"] == ["uniqueItems"]
        assert report["valid"] == validator.is_valid(json.loads(out["text"]))
        assert (report["error"] is None) == report["valid"]
        seen.add(report["valid"])
    assert seen == {True, False}, "random logits repeat an item sometimes, not always"


def test_an_exact_schema_reports_nothing_unenforced(engine):
    out = engine.generate(
        "x", {"temperature": 1.0, "max_new_tokens": 60, "seed": 1, "json_schema": EXACT}
    )
    assert out["meta_info"]["json_schema"] == {"unenforced": [], "valid": True, "error": None}
    cut = engine.generate(
        "x", {"temperature": 1.0, "max_new_tokens": 2, "seed": 1, "json_schema": EXACT}
    )
    assert cut["meta_info"]["finish_reason"]["type"] == "length"
    assert cut["meta_info"]["json_schema"]["valid"] is False  # honest about a cut-off output


def test_strict_mode_refuses_per_request(engine):
    with pytest.raises(ConstraintError, match="'uniqueItems'"):
        engine.generate(
            "x", {"max_new_tokens": 5, "json_schema": UNIQUE_TAGS, "schema_mode": "strict"}
        )
    with pytest.raises(InvalidRequestError, match="schema_mode"):
        engine.generate("x", {"max_new_tokens": 5, "json_schema": EXACT, "schema_mode": "loose"})


def test_other_constraints_have_no_report(engine):
    out = engine.generate("x", {"max_new_tokens": 5, "regex": "[ab]{3}"})
    assert "json_schema" not in out["meta_info"]
