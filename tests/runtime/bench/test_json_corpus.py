"""`spruce bench json --corpus`: the report over a small corpus, and a backtracking match
that is cut at its timeout instead of hanging the run."""

from __future__ import annotations

import json
import shutil

import pytest
from spruce.runtime.bench import json_bench
from support import DATA_DIR


def test_corpus_report_counts_each_engine(tmp_path):
    for name in ("agripparc-1.2", "agripparc-1.3"):
        shutil.copy(DATA_DIR / "schemastore" / f"{name}.json", tmp_path)
    bad = {"schema": {"type": "integer", "minimum": 3}, "valid": [3, 40], "invalid": [2, "x"]}
    (tmp_path / "small.json").write_text(json.dumps(bad))
    report = json_bench.corpus_report(str(tmp_path))
    assert report["schemas"] == report["local_schemas"] == 3
    spruce = report["engines"]["spruce"]
    assert spruce["passed"] == spruce["compiled"] == 3 and spruce["accepted_invalid"] == 0
    assert spruce["match_timeouts"] == 0 and set(spruce["compile_s"]) == {"p50", "p90", "p99", "max"}
    assert report["features"]["minimum"]["schemas"] == 1


def test_a_backtracking_match_times_out_and_the_schema_does_not_pass(monkeypatch):
    pytest.importorskip("regex")
    monkeypatch.setattr(json_bench, "MATCH_TIMEOUT_S", 0.2)
    matches = json_bench._full_matcher("(a|aa)+b")
    with pytest.raises(TimeoutError):
        matches("a" * 60)

    def checker(schema):  # compiles, then every match backtracks past the timeout
        return (lambda value, orders: matches("a" * 60)), (), False

    entry = {"schema": {"type": "string"}, "valid": ["x"], "invalid": []}
    result = json_bench._check_entry(checker, entry)
    assert result["compiled"] and result["match_timeout"] and not result["passed"]


def test_a_regex_too_large_to_match_counts_as_not_compiled(monkeypatch):
    monkeypatch.setattr(json_bench, "MAX_MATCH_REGEX_CHARS", 100)

    def checker(schema):  # an engine whose regex is over the bound
        matches = json_bench._full_matcher("(?:a|b)" * 20)
        return (lambda value, orders: matches(value)), (), False

    entry = {"schema": {"type": "string"}, "valid": ["x"], "invalid": []}
    result = json_bench._check_entry(checker, entry)
    assert not result["compiled"] and not result["passed"]
