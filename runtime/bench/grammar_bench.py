"""Grammar engines side by side: pass rates and per-token mask cost over a corpus, in one run.

MaskBench's method, on the bundled tokenizer: for each constraint of the corpus, compile, then
walk each valid example (compact JSON) token by token: per token compute the mask (timed) and
commit the token; at the end the grammar must accept. Invalid examples are committed the same
way (untimed) and must be refused. Measured per engine: Spruce's grammar backends (`spruce`,
`llguidance`, `auto`: make_spec + GrammarCompiler, cursor.prepare_mask + fill_bitmask) and,
when installed, the peers called directly: llguidance (LLMatcher) and XGrammar.

    spruce bench grammar --corpus ../shared/corpora/schemastore      # JSON schemas
    spruce bench grammar --kind regex                                 # the built-in regex set

A corpus file is {"name", "schema", "valid": [...], "invalid": [...]}. An example is written
with its keys as published and, where an engine writes objects in a fixed order, reordered to
that order (the schema's definition order; Spruce's recorded order): it is accepted if one of
those texts is.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path

from spruce.runtime.bench import write_json

USES_ENGINE = False

DEFAULT_CORPUS = "tests/data/schemastore"
WALK_TIMEOUT_S = (
    120  # one constraint's examples on one engine: past it, the constraint does not pass
)
FALLBACK = (
    "llguidance, else spruce"  # the derived row: llguidance's result, spruce's where it refuses
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--corpus", default=DEFAULT_CORPUS, help="folder of {name, schema, valid, invalid} files"
    )
    parser.add_argument(
        "--kind", choices=("json_schema", "regex"), default="json_schema",
        help="json_schema: the corpus; regex: the built-in set (DSL dtypes, choices, regexes from the tests)",
    )  # fmt: skip
    parser.add_argument(
        "--engines",
        default=None,
        help="comma-separated subset of the engines (default: all installed)",
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N constraints")
    parser.add_argument("--output-json", default=None)


def run(args: argparse.Namespace, engine_options: dict | None = None) -> int:
    entries = regex_entries() if args.kind == "regex" else load_corpus(args.corpus)
    result = bench(
        entries[: args.limit], args.kind, args.engines.split(",") if args.engines else None
    )
    print(table(result))
    write_json(args.output_json, result)
    return 0


def load_corpus(folder: str) -> list[dict]:
    entries = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]
    if not entries:
        raise SystemExit(
            f"no *.json corpus files in {folder} (each {{name, schema, valid, invalid}})"
        )
    return entries


# -- the run -------------------------------------------------------------------------------------


def bench(entries: list[dict], kind: str = "json_schema", names: list[str] | None = None) -> dict:
    """Every engine over `entries`: {"kind", "constraints", "engines": {name: summary},
    "per_constraint": {name: [record]}} (records without their mask samples)."""
    from spruce.runtime.models.loading.files import load_tokenizer

    tokenizer = load_tokenizer()
    engines = make_engines(tokenizer, names)
    texts = [_example_texts(e, kind) for e in entries]
    records: dict[str, list[dict]] = {}
    for name, engine in engines.items():
        try:
            records[name] = [measure(engine, kind, e, t, tokenizer) for e, t in zip(entries, texts)]
        finally:
            engine.close()
    if "spruce" in records and _llguidance_row(records):
        llg = records[_llguidance_row(records)]
        records[FALLBACK] = [a if a["compiled"] else b for a, b in zip(llg, records["spruce"])]
    summaries = {name: summary(rows) for name, rows in records.items()}
    _add_ratios(summaries)
    for rows in records.values():
        for row in rows:
            row.pop("masks", None)
            row.pop("repeat_masks", None)
    return {"kind": kind, "constraints": len(entries), "engines": summaries, "per_constraint": records,
            "versions": {name: e.version for name, e in engines.items()}}  # fmt: skip


def _llguidance_row(records: dict) -> str | None:
    return (
        "spruce/llguidance"
        if "spruce/llguidance" in records
        else "llguidance"
        if "llguidance" in records
        else None
    )


def measure(engine, kind: str, entry: dict, texts: dict, tokenizer) -> dict:
    """One constraint on one engine: compiled, time to first mask, the mask times of its valid
    walks, passed, invalid examples accepted (and of those, excused: they break a keyword the
    engine reported unenforced)."""
    record = {"name": entry.get("name", ""), "compiled": False, "passed": False, "ttfm_s": None,
              "masks": [], "repeat_masks": [], "accepted_invalid": 0, "excused": 0, "unenforced": []}  # fmt: skip
    from spruce.runtime.bench.grammar_engines import COMPILE_TIMEOUT_S

    with _deadline(COMPILE_TIMEOUT_S):
        try:
            start = time.perf_counter()
            compiled = engine.compile(kind, entry["schema"])
            cursor = compiled.cursor()
            cursor.mask()
            record["ttfm_s"] = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - refused, crashed or past the deadline: not compiled
            record["error"] = _short(e)
            return record
    record.update(compiled=True, unenforced=list(compiled.unenforced))
    with _deadline(WALK_TIMEOUT_S):
        try:
            record["passed"] = _walk_examples(compiled, entry, texts, tokenizer, record)
        except Exception as e:  # noqa: BLE001 - a mask past its bound, the deadline: not passed
            record["error"] = _short(e)
    if hasattr(engine, "release"):
        engine.release()
    return record


def _walk_examples(compiled, entry: dict, texts: dict, tokenizer, record: dict) -> bool:
    from spruce.constrained.report import excused

    valid = True
    for value, candidates in zip(entry["valid"], texts["valid"]):
        walks = (
            (ids, _timed_walk(compiled, ids))
            for ids in _ids(compiled, value, candidates, tokenizer)
        )
        ids, times = next(((ids, t) for ids, t in walks if t), (None, None))
        valid = valid and times is not None
        if times:
            record["masks"] += times
            record["repeat_masks"] += (
                _timed_walk(compiled, ids) or []
            )  # the same text again: cached work
    for value, candidates in zip(entry["invalid"], texts["invalid"]):
        if any(_accepts(compiled, ids) for ids in _ids(compiled, value, candidates, tokenizer)):
            record["accepted_invalid"] += 1
            record["excused"] += bool(
                entry.get("kind") != "regex"
                and excused(entry["schema"], value, compiled.unenforced)
            )
    return valid and record["accepted_invalid"] == 0


def _ids(compiled, value, candidates: list[str], tokenizer):
    """The token ids of each text an example may be written as (the engine's own key order last)."""
    texts = list(candidates)
    own = compiled.text(value)
    if own is not None and own not in texts:
        texts.append(own)
    for text in texts:
        yield tokenizer.encode(text, add_special_tokens=False)


def _timed_walk(compiled, ids: list[int]) -> list[float] | None:
    """The mask times along `ids` and at the end; None if a token is not in its mask, is
    refused, or the grammar cannot end there."""
    cursor, times = compiled.cursor(), []
    for token_id in [*ids, None]:
        start = time.perf_counter()
        cursor.mask()
        times.append(time.perf_counter() - start)
        if token_id is None:
            return times if cursor.can_end() else None
        if not cursor.allows(token_id) or not cursor.accept(token_id):
            return None
    return None


def _accepts(compiled, ids: list[int]) -> bool:
    cursor = compiled.cursor()
    return all(cursor.accept(t) for t in ids) and cursor.can_end()


def _example_texts(entry: dict, kind: str) -> dict:
    """Per example, the texts every engine may be given: as published (compact) and with its
    keys in the schema's definition order."""
    if kind == "regex":
        return {"valid": [[v] for v in entry["valid"]], "invalid": [[v] for v in entry["invalid"]]}
    from spruce.constrained.schema.json_schema import canonical_instance, declared_orders

    orders = declared_orders(entry["schema"])

    def forms(value) -> list[str]:
        return list(
            dict.fromkeys(
                [
                    json.dumps(value, ensure_ascii=False, separators=(",", ":")),
                    canonical_instance(value, orders),
                ]
            )
        )

    return {
        "valid": [forms(v) for v in entry["valid"]],
        "invalid": [forms(v) for v in entry["invalid"]],
    }


class _deadline:
    """SIGALRM at `seconds`, then every second (code that catches the first TimeoutError in a
    broad except gets another until it gives up)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        signal.signal(signal.SIGALRM, _raise_timeout)
        signal.setitimer(signal.ITIMER_REAL, self.seconds, 1.0)

    def __exit__(self, *_) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _raise_timeout(*_) -> None:
    raise TimeoutError("past the bench's deadline")


def _short(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error)[:160]}"


# -- figures -------------------------------------------------------------------------------------


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict:
    """{"p50": ..., ..., "mean", "max"} of `values` ({} when empty)."""
    values = sorted(values)
    if not values:
        return {}
    out = {f"p{q}": values[min(len(values) - 1, len(values) * q // 100)] for q in qs}
    return out | {"mean": sum(values) / len(values), "max": values[-1]}


def summary(rows: list[dict]) -> dict:
    masks = [m for r in rows for m in r["masks"]]
    return {
        "passed": sum(r["passed"] for r in rows),
        "compiled": sum(r["compiled"] for r in rows),
        "invalid_accepted_schemas": sum(r["accepted_invalid"] > r["excused"] for r in rows),
        "invalid_accepted": sum(r["accepted_invalid"] - r["excused"] for r in rows),
        "excused": sum(r["excused"] for r in rows),
        "ttfm_s": percentiles([r["ttfm_s"] for r in rows if r["ttfm_s"] is not None], (50, 90)),
        "mask_s": percentiles(masks, (50, 75, 99)),
        "repeat_mask_s": percentiles([m for r in rows for m in r["repeat_masks"]], (50, 99)),
        "masks": len(masks),
        "over_20ms": sum(m > 0.02 for m in masks),
    }


def _add_ratios(summaries: dict) -> None:
    """Each engine's mask figures over the llguidance peer's (same run)."""
    base = summaries.get("llguidance", {}).get("mask_s")
    for s in summaries.values():
        if base and s["mask_s"]:
            s["vs_llguidance"] = {
                k: s["mask_s"][k] / base[k] for k in ("p50", "p99", "mean") if base[k] > 0
            }


COLUMNS = (
    "engine", "pass", "compiled", "with an invalid example accepted", "time to first mask p50 / p90",
    "mask per token p50 / p75 / p99 / mean / max", "masks", "mask p50 / p99 / mean vs llguidance",
    "same text again: mask p50 / p99 / mean",
)  # fmt: skip


def table(result: dict) -> str:
    n = result["constraints"]
    lines = [
        f"{n} {result['kind']} constraints, bundled tokenizer (SmolLM2), one run",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "| " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    for name, s in result["engines"].items():
        version = result["versions"].get(name, "")
        ttfm = " / ".join(_ms(s["ttfm_s"].get(k)) for k in ("p50", "p90"))
        mask = " / ".join(_us(s["mask_s"].get(k)) for k in ("p50", "p75", "p99", "mean", "max"))
        ratio = " / ".join(f"{v:.2f}x" for v in s.get("vs_llguidance", {}).values()) or "-"
        repeat = " / ".join(_us(s["repeat_mask_s"].get(k)) for k in ("p50", "p99", "mean"))
        lines.append(
            f"| {name}{' ' + version if version else ''} | {s['passed']} ({s['passed'] / max(n, 1):.1%}) | {s['compiled']} "
            f"| {s['invalid_accepted_schemas']} | {ttfm} | {mask} | {s['masks']:,} | {ratio} | {repeat} |"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f} ms"


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:,.0f} us"


# -- engines ---------------------------------------------------------------------------------------


def make_engines(tokenizer, names: list[str] | None = None) -> dict:
    """name -> engine (compile(kind, value) -> compiled; version; close()), the installed ones."""
    from spruce.runtime.bench import grammar_engines as eng

    makers = {
        f"spruce/{b}" if b != "spruce" else "spruce": (eng.SpruceEngine, b)
        for b in eng.SPRUCE_BACKENDS
    }
    makers |= {"llguidance": (eng.LLGuidanceEngine, None), "xgrammar": (eng.XGrammarEngine, None)}
    unknown = set(names or ()) - set(makers)
    if unknown:
        raise SystemExit(
            f"unknown engines {sorted(unknown)}; these are installed: {', '.join(makers)}"
        )
    engines = {}
    for name, (make, backend) in makers.items():
        if names is None or name in names:
            engine = make.create(tokenizer, backend)
            if engine is not None:
                engines[name] = engine
    return engines


# -- the regex set -------------------------------------------------------------------------------


def regex_entries() -> list[dict]:
    """The DSL dtypes, choices lists and regexes from the tests and examples, each with valid
    and invalid instances."""
    from spruce.constrained.core.patterns import DTYPE_REGEXES, choices_regex

    colors = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
    countries = ["France", "Germany", "Italy", "Spain", "Portugal", "Poland", "Sweden", "Norway", "Finland",
                 "Denmark", "Austria", "Belgium", "Netherlands", "Switzerland", "Greece", "Ireland"]  # fmt: skip
    cases = [  # name, regex, valid, invalid
        ("dtype int", DTYPE_REGEXES["int"], ["0", "-42", "1234567890"], ["01", "4.2", "-"]),
        ("dtype float", DTYPE_REGEXES["float"], ["3.14", "-0.5", "1e10", "42"], ["3.", ".5", "1e"]),
        ("dtype bool", DTYPE_REGEXES["bool"], ["True", "False"], ["true", "Tru"]),
        ("dtype str", DTYPE_REGEXES["str"], ['"hello world"', '"a \\"quoted\\" word"', '""'], ['"open', "bare"]),
        ("choices yes/no", choices_regex(["yes", "no"]), ["yes", "no"], ["maybe", "ye"]),
        ("choices colors", choices_regex(colors), colors, ["pink", "gree"]),
        ("choices countries", choices_regex(countries), countries, ["Japan", "Fra"]),
        ("phone", r"\d{3}-\d{4}", ["555-1234"], ["5551234", "55-12345"]),
        ("digits", r"[0-9]+", ["7", "2024"], ["", "12a"]),
        ("words", r"[a-z ]{1,20}", ["hello there", "a"], ["Hello", "x" * 21]),
        ("ab suffix", r"(a|b)*a(a|b){24}c", ["b" * 3 + "a" + "ab" * 12 + "c"], ["a" * 10 + "c"]),
        ("email", r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}", ["jane.doe@example.com"], ["jane@", "@x.io"]),
        ("iso date", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", ["2024-02-29", "1999-12-31"], ["2024-13-01"]),
        ("ipv4", r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)", ["192.168.0.1", "8.8.8.8"], ["256.1.1.1"]),
        ("uuid", r"[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567-e89b"]),
        ("sentence", r"[A-Z][a-z]+( [a-z]+){2,12}\.", ["The cat sat on the mat."], ["the cat sat.", "The cat"]),
    ]  # fmt: skip
    return [
        {"name": n, "kind": "regex", "schema": r, "valid": v, "invalid": i} for n, r, v, i in cases
    ]
