"""`spruce bench grammar`: the table's structure and sane figures on a few schemas (no timing
thresholds), the counting of invalid examples, and the built-in regex set."""

from __future__ import annotations

import json

from support import DATA_DIR

from spruce.runtime.bench import grammar_bench

SMALL = {
    "name": "small",
    "schema": {"type": "integer", "minimum": 3},
    "valid": [3, 40],
    "invalid": [2, "x"],
}


def corpus() -> list[dict]:
    names = ("agripparc-1.2", "agripparc-1.3")
    return [json.loads((DATA_DIR / "schemastore" / f"{n}.json").read_text()) for n in names] + [
        SMALL
    ]


def test_every_engine_gets_a_row_with_sane_figures():
    result = grammar_bench.bench(corpus())
    engines = result["engines"]
    assert "spruce" in engines and "llguidance" in engines and grammar_bench.FALLBACK in engines
    assert result["constraints"] == 3
    for name, s in engines.items():
        assert 0 <= s["passed"] <= s["compiled"] <= 3, name
        assert s["invalid_accepted"] >= s["invalid_accepted_schemas"] >= 0
        if s["passed"]:
            ttfm, mask = s["ttfm_s"], s["mask_s"]
            assert 0 < ttfm["p50"] <= ttfm["p90"] <= ttfm["max"]
            assert 0 < mask["p50"] <= mask["p75"] <= mask["p99"] <= mask["max"]
            assert 0 < mask["mean"] <= mask["max"]
            assert s["masks"] > 10 and s["repeat_mask_s"]["p50"] > 0
    spruce = engines["spruce"]
    assert spruce["passed"] == 3 and spruce["invalid_accepted"] == 0
    assert engines["llguidance"]["vs_llguidance"] == {"p50": 1.0, "p99": 1.0, "mean": 1.0}
    lines = grammar_bench.table(result).splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    assert len(rows) == 2 + len(engines)  # header, separator, one row per engine
    assert all(row.count(" | ") == len(grammar_bench.COLUMNS) - 1 for row in rows)
    assert {r["name"] for r in result["per_constraint"]["spruce"]} == {e["name"] for e in corpus()}


class _AnythingGoes:
    """An engine whose grammar allows every token anywhere."""

    unenforced = ()

    def compile(self, kind, value):
        return self

    def cursor(self):
        return self

    def text(self, instance):
        return None

    def mask(self):
        pass

    def allows(self, token_id):
        return True

    def accept(self, token_id):
        return True

    def can_end(self):
        return True


class _Refuses(_AnythingGoes):
    def compile(self, kind, value):
        raise ValueError("not this schema")


def test_invalid_examples_accepted_and_refusals_are_counted():
    from spruce.runtime.models.loading.files import load_tokenizer

    tokenizer = load_tokenizer()
    texts = grammar_bench._example_texts(SMALL, "json_schema")
    loose = grammar_bench.measure(_AnythingGoes(), "json_schema", SMALL, texts, tokenizer)
    assert loose["compiled"] and not loose["passed"] and loose["accepted_invalid"] == 2
    assert len(loose["masks"]) >= 2 * len(SMALL["valid"])  # a mask per token and one at the end
    refused = grammar_bench.measure(_Refuses(), "json_schema", SMALL, texts, tokenizer)
    assert (
        not refused["compiled"] and not refused["passed"] and "not this schema" in refused["error"]
    )
    figures = grammar_bench.summary([loose, refused])
    assert (
        figures["compiled"] == 1
        and figures["passed"] == 0
        and figures["invalid_accepted_schemas"] == 1
    )


def test_the_regex_set_passes_on_spruce():
    result = grammar_bench.bench(grammar_bench.regex_entries(), "regex", ["spruce"])
    spruce = result["engines"]["spruce"]
    failed = [r["name"] for r in result["per_constraint"]["spruce"] if not r["passed"]]
    assert not failed and spruce["invalid_accepted"] == 0
