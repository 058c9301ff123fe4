"""Structured output: JSON-schema requests with jump-forward on vs off in the same run.

Fills the schemas of a folder (default: tests/data/schemas, the shared set) on the model,
greedy, chat-formatted; reports model forward passes, output tokens/s, mean latency, the
mask cost (bitmask fill + apply per step, as a share of the decode step) and each schema's
compile time, cold and cached. Both engines share one copy of the weights.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path

from spruce.runtime.bench import write_json

USES_ENGINE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schemas", default="tests/data/schemas", help="folder of *.json schemas")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--corpus", default=None,
        help="folder of {schema, valid, invalid} files: pass rates at the regex level side by side with raw "
        "outlines-core and XGrammar (if installed: pip install --no-deps xgrammar apache-tvm-ffi); no model run",
    )  # fmt: skip
    parser.add_argument(
        "--index", action="store_true",
        help="with --corpus: also compile each converted schema's grammar with the bundled tokenizer (cold "
        "conversion and compile times, mask cost while decoding, XGrammar's compile on the same vocabulary)",
    )  # fmt: skip


# A typical flat 8-field schema, for the compile-time figure.
EIGHT_FIELDS = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    },
    "required": ["id", "name", "email", "age", "score", "active", "role", "tags"],
}


def load_schemas(folder: str) -> dict[str, dict]:
    paths = sorted(Path(folder).glob("*.json"))
    if not paths:
        raise SystemExit(f"no *.json schemas in {folder} (give --schemas DIR)")
    return {p.stem: json.loads(p.read_text()) for p in paths}


def requests(engine, schemas: dict[str, dict], n: int, max_new: int) -> tuple[list[str], list[dict]]:
    names = [list(schemas)[i % len(schemas)] for i in range(n)]
    prompts = [
        engine.apply_chat_template([{"role": "user", "content": f"Give example {i + 1} of a {name.replace('_', ' ')} as JSON."}])
        for i, name in enumerate(names)
    ]
    params = [{"json_schema": schemas[name], "temperature": 0, "max_new_tokens": max_new} for name in names]
    return prompts, params


def compile_times(engine, schemas: dict[str, dict]) -> dict[str, dict]:
    from spruce.constrained import make_spec

    out = {}
    compiler = engine.core.compiler
    for name, schema in schemas.items():
        spec = make_spec(json_schema=schema)
        start = time.perf_counter()
        compiler.compile(spec)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(spec)
        out[name] = {"cold_s": cold, "cached_us": (time.perf_counter() - start) * 1e6, "fields": _fields(schema)}
    return out


def _fields(schema: dict) -> int:
    return len(schema.get("properties", {}))


def one_at_a_time(engine, prompts: list[str], params: list[dict]) -> dict:
    """Each request alone: forward passes and latency per request (no batching effects)."""
    core = engine.core
    passes, latency, texts, jumped = 0, 0.0, [], 0
    for prompt, p in zip(prompts, params):
        engine.flush_cache()
        core.step_log = []
        out = engine.generate(prompt, p)
        passes += len(core.step_log)
        latency += out["meta_info"]["e2e_latency"]
        jumped += out["meta_info"]["jump_forward_tokens"]
        texts.append(out["text"])
    core.step_log = None
    return {"forward_passes": passes, "mean_latency_s": latency / len(prompts), "jump_forward_tokens": jumped, "texts": texts}


def batched(engine, prompts: list[str], params: list[dict]) -> dict:
    """All requests together: throughput, and the mask's cost per decode step."""
    engine.flush_cache()
    core = engine.core
    core.step_log = []
    mask = core.grammar_mask
    mask.seconds, mask.calls = 0.0, 0
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    steps, core.step_log = core.step_log, None
    top = max(st.batch_size for st in steps)
    decode = [st.seconds for st in steps if st.all_decode and st.batch_size == top]
    return {
        "output_tokens_per_s": sum(len(o["output_ids"]) for o in outs) / seconds,
        "batch": top,
        "mask_ms_per_step": mask.seconds / max(mask.calls, 1) * 1e3,
        "decode_step_ms": sum(decode) / max(len(decode), 1) * 1e3,
    }


def measure(engine, prompts: list[str], params: list[dict]) -> dict:
    return {**one_at_a_time(engine, prompts, params), **batched(engine, prompts, params)}


def run(args: argparse.Namespace, engine_options: dict) -> int:
    from spruce.runtime.engine.offline import Engine

    if args.corpus:
        result = corpus_report(args.corpus, index=args.index)
        print_corpus(result)
        write_json(args.output_json, result)
        return 0
    options = dict(engine_options)
    options.pop("disable_jump_forward", None)
    schemas = load_schemas(args.schemas)
    on = Engine(**options)
    off = Engine(loaded=on.core.loaded, **options, disable_jump_forward=True)
    result = {"compile": compile_times(on, {**schemas, "eight_fields": EIGHT_FIELDS})}
    compile_times(off, schemas)  # warm the second engine's compiler too: time decoding only
    prompts, params = requests(on, schemas, args.num_requests, args.max_new_tokens)
    result["jump_forward"] = measure(on, prompts, params)
    result["no_jump_forward"] = measure(off, prompts, params)
    a, b = result["jump_forward"], result["no_jump_forward"]
    result["forward_pass_ratio"] = b["forward_passes"] / a["forward_passes"]
    result["latency_ratio"] = b["mean_latency_s"] / a["mean_latency_s"]
    result["identical_texts"] = sum(x == y for x, y in zip(a.pop("texts"), b.pop("texts")))
    result["mask_share_of_decode_step"] = b["mask_ms_per_step"] / max(b["decode_step_ms"], 1e-9)
    print_report(result, args.num_requests)
    write_json(args.output_json, result)
    return 0


def print_report(r: dict, n: int) -> None:
    a, b = r["jump_forward"], r["no_jump_forward"]
    print(f"{'':26s} {'jump-forward':>14s} {'off':>10s}")
    rows = [
        ("forward_passes", "forward passes (1 by 1)"),
        ("mean_latency_s", "mean latency s (1 by 1)"),
        ("output_tokens_per_s", f"output tok/s (batch {b['batch']})"),
    ]
    for key, label in rows:
        print(f"{label:26s} {a[key]:14.2f} {b[key]:10.2f}")
    print(f"forward passes cut {r['forward_pass_ratio']:.2f}x, latency cut {r['latency_ratio']:.2f}x, "
          f"identical texts {r['identical_texts']}/{n}, jump-forwarded tokens {a['jump_forward_tokens']}")
    print(f"mask fill+apply {b['mask_ms_per_step']:.2f} ms per step = {r['mask_share_of_decode_step']:.1%} of a decode step"
          f" ({b['decode_step_ms']:.1f} ms at batch {b['batch']})")
    for name, c in r["compile"].items():
        print(f"  compile {name:16s} {c['fields']:2d} fields  cold {c['cold_s'] * 1e3:7.1f} ms  cached {c['cached_us']:6.1f} us")


# -- --corpus: pass rates (compiles, accepts every valid example, refuses every invalid one) ------
# Every engine sees each example as compact JSON with its keys in the schema's definition order
# (all three write objects in that order; Spruce's recorded order also merges allOf parts), and
# is timed on the same machine in one run.


CONVERT_TIMEOUT_S = 30  # a conversion past it counts as not compiled (the server's grammar timeout)
MATCH_TIMEOUT_S = 10  # one example against one regex: past it (backtracking), the schema does not pass
# A larger regex counts as not compiled: Python's regex parsers take minutes on it, beyond the
# reach of the deadline (raw outlines-core writes 44 MB for one SchemaStore schema), and no
# token index could be built from it either.
MAX_MATCH_REGEX_CHARS = 1_000_000


def _deadline(*_) -> None:
    raise TimeoutError(f"not converted within {CONVERT_TIMEOUT_S} s")


def corpus_report(folder: str, index: bool = False) -> dict:
    from spruce.constrained.schema_refs import remote_refs

    signal.signal(signal.SIGALRM, _deadline)
    entries = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]
    if not entries:
        raise SystemExit(f"no *.json corpus files in {folder} (each {{schema, valid, invalid}})")
    local = [e for e in entries if not remote_refs(e["schema"])]
    checkers = {"spruce": _spruce_checker, "outlines-core": _outlines_checker, "xgrammar": _xgrammar_checker}
    out = {"schemas": len(entries), "local_schemas": len(local), "engines": {}, "features": {}}
    features = [_features(e["schema"]) for e in entries]
    for name, make in checkers.items():
        checker = make()
        if checker is None:
            continue
        results = [_check_entry(checker, e) for e in entries]
        out["engines"][name] = _summary(results, [not remote_refs(e["schema"]) for e in entries])
        for used, result in zip(features, results):
            for feature in used:
                row = out["features"].setdefault(feature, {"schemas": 0})
                row["schemas"] += name == "spruce"
                row[name] = row.get(name, 0) + result["passed"]
    if index:
        out["index"] = index_report(local)
    return out


def _check_entry(checker, entry: dict) -> dict:
    """One schema: compiled, passed, seconds, invalid examples accepted (and of those, the
    ones excused: they break a keyword the engine reported unenforced), unenforced keywords."""
    from spruce.constrained.json_schema import declared_orders
    from spruce.constrained.report import excused as excused_invalid

    result = {"compiled": False, "passed": False, "seconds": None, "accepted_invalid": 0, "excused": 0,
              "unenforced": (), "loose": False}  # fmt: skip
    start = time.perf_counter()
    # at the deadline, then every second: a converter that catches the first TimeoutError
    # (a broad except in a measuring loop) gets another until it gives up
    signal.setitimer(signal.ITIMER_REAL, CONVERT_TIMEOUT_S, 1.0)
    try:
        accepts, unenforced, loose = checker(entry["schema"])
    except Exception:  # noqa: BLE001 - refused, crashed or past the deadline: not compiled
        return result
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    result.update(compiled=True, seconds=time.perf_counter() - start, unenforced=unenforced, loose=loose)
    orders = declared_orders(entry["schema"])
    try:
        wrong = [v for v in entry["invalid"] if accepts(v, orders)]
        valid = all(accepts(v, orders) for v in entry["valid"])
    except TimeoutError:  # a backtracking match: the schema cannot be shown to pass
        result["match_timeout"] = True
        return result
    excused = [v for v in wrong if excused_invalid(entry["schema"], v, unenforced)]
    result.update(accepted_invalid=len(wrong), excused=len(excused))
    result["passed"] = not wrong and valid
    return result


def _summary(results: list[dict], local: list[bool]) -> dict:
    times = sorted(r["seconds"] for r in results if r["compiled"])
    unenforced: dict[str, int] = {}
    for r in results:
        for keyword in r["unenforced"]:
            unenforced[keyword] = unenforced.get(keyword, 0) + 1
    return {
        "passed": sum(r["passed"] for r in results),
        "compiled": len(times),
        "compiled_local": sum(r["compiled"] for r, is_local in zip(results, local) if is_local),
        "loosened_whole": sum(r["loose"] for r in results),  # compiled as "any object" (size cap)
        "match_timeouts": sum(r.get("match_timeout", False) for r in results),
        "accepted_invalid": sum(r["accepted_invalid"] for r in results),
        "accepted_invalid_enforced": sum(r["accepted_invalid"] - r["excused"] for r in results),
        "compile_s": percentiles(times),
        "unenforced": unenforced,
    }


def percentiles(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {}
    return {f"p{q}": values[min(len(values) - 1, len(values) * q // 100)] for q in (50, 90, 99)} | {"max": values[-1]}


def _features(schema) -> list[str]:
    """The keywords a schema uses (for per-feature pass rates), remote $refs as "$ref(remote)"."""
    from spruce.constrained.schema_context import Context, SchemaOptions
    from spruce.constrained.schema_refs import remote_refs
    from spruce.constrained.schema_size import subtree_keywords

    used = subtree_keywords(schema, "#", Context(schema, SchemaOptions()))
    if "$ref" in json.dumps(schema):
        used.add("$ref(remote)" if remote_refs(schema) else "$ref")
    return sorted(used)


def _full_matcher(pattern: str):
    """text -> whether `pattern` matches all of it; TimeoutError past MATCH_TIMEOUT_S (Python's
    `re` backtracks without a bound on some real schemas' regexes; the `regex` module, which
    transformers installs, takes a timeout)."""
    if len(pattern) > MAX_MATCH_REGEX_CHARS:
        raise ValueError(f"regex of {len(pattern)} characters: over {MAX_MATCH_REGEX_CHARS}")
    try:
        import regex
    except ImportError:
        import re

        compiled = re.compile(pattern)
        return lambda text: bool(compiled.fullmatch(text))
    compiled = regex.compile(pattern)
    return lambda text: bool(compiled.fullmatch(text, timeout=MATCH_TIMEOUT_S))


def _spruce_checker():
    from spruce.constrained.byte_dfa import DEAD, ByteDFA
    from spruce.constrained.byte_nfa import build_nfa
    from spruce.constrained.json_schema import canonical_instance, convert_schema

    def check(schema):  # Spruce's own automaton (the one its token masks walk)
        converted = convert_schema(schema)
        dfa = ByteDFA(build_nfa(converted.regex))

        def matches(text: str) -> bool:
            state = dfa.walk(dfa.initial, text.encode())
            return state != DEAD and dfa.is_accepting(state)

        orders = converted.orders  # the order its grammar writes (definition order, allOf parts merged)
        accepts = lambda v, _: matches(canonical_instance(v, orders))  # noqa: E731
        return accepts, converted.unenforced, "#" in converted.loosened

    return check


def _outlines_checker():
    import outlines_core
    from spruce.constrained.json_schema import canonical_instance

    def check(schema):  # compact output: no whitespace between tokens
        matches = _full_matcher(outlines_core.json_schema.build_regex_from_schema(json.dumps(schema), ""))
        return (lambda v, orders: matches(canonical_instance(v, orders))), (), False

    return check


def _xgrammar_checker():
    try:
        import xgrammar
        from xgrammar.testing import _is_grammar_accept_string
    except ImportError:
        return None
    from spruce.constrained.json_schema import canonical_instance

    def check(schema):
        grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        return (lambda v, orders: _is_grammar_accept_string(grammar, canonical_instance(v, orders))), (), False

    return check


def index_report(entries: list[dict], timeout_s: float = 30.0) -> dict:
    """Cold grammar builds with the bundled tokenizer, for every schema Spruce converts:
    Spruce's conversion (schema -> regex, in-process), its compile (the byte NFA in a worker
    process, then the initial state's token mask: what a request waits for before its first
    token), the first 32 masks of a walk through a valid example (the lazy DFA and mask work a
    request meets while decoding), and XGrammar's compile_json_schema on the same vocabulary."""
    from spruce.constrained import GrammarCompiler, make_spec
    from spruce.constrained.json_schema import canonical_instance, convert_schema
    from spruce.runtime.models.loading.files import load_tokenizer

    tokenizer = load_tokenizer()
    compiler = GrammarCompiler(tokenizer, cache_size=1, timeout_s=timeout_s, cache_bytes=1 << 40)
    compiler.compile(make_spec(regex="warm[0-9]"))  # a worker started: process start-up is not a compile
    xgrammar_compile = _xgrammar_compiler(tokenizer)
    convert_s, compile_s, total_s, walk_ms, failed, xgrammar_s = [], [], [], [], [], []
    try:
        for entry in entries:
            start = time.perf_counter()
            try:
                spec = make_spec(json_schema=entry["schema"])
            except Exception:  # noqa: BLE001, S112 - not converted: counted by the pass rates
                continue
            converted = time.perf_counter()
            try:
                grammar = compiler.compile(spec)
            except Exception as e:  # noqa: BLE001 - over the timeout or the memory cap
                failed.append(f"{entry['name']}: {str(e)[:120]}")
                continue
            done = time.perf_counter()
            convert_s.append(converted - start)
            compile_s.append(done - converted)
            total_s.append(done - start)
            if entry["valid"]:
                orders = convert_schema(entry["schema"]).orders  # the key order the grammar writes
                walk_ms.append(_mask_walk_ms(grammar, tokenizer, canonical_instance(entry["valid"][0], orders)))
            if xgrammar_compile is not None:
                xgrammar_s.append(xgrammar_compile(entry["schema"]))
    finally:
        compiler.close()
    return {"built": len(compile_s), "failed": failed, "convert_s": percentiles(convert_s),
            "compile_s": percentiles(compile_s), "total_s": percentiles(total_s),
            "mask_ms": percentiles([m for m in walk_ms if m is not None]),
            "xgrammar_s": percentiles([s for s in xgrammar_s if s is not None]),
            "xgrammar_failed": sum(s is None for s in xgrammar_s)}  # fmt: skip


def _mask_walk_ms(grammar, tokenizer, text: str, steps: int = 32) -> float | None:
    """Mean time of a fresh mask along the tokens of `text` (None if the grammar refuses them:
    an example in another key order)."""
    cursor, spent, count = grammar.cursor(), 0.0, 0
    for token_id in tokenizer.encode(text, add_special_tokens=False)[:steps]:
        start = time.perf_counter()
        grammar.mask(cursor.state)
        spent += time.perf_counter() - start
        count += 1
        if not cursor.accept_token(token_id):
            return None
    return 1000 * spent / max(count, 1)


def _xgrammar_compiler(tokenizer):
    try:
        import xgrammar
    except ImportError:
        return None
    info = xgrammar.TokenizerInfo(
        tokenizer.token_bytes(), xgrammar.VocabType.RAW, vocab_size=tokenizer.vocab_size,
        stop_token_ids=sorted(tokenizer.eos_token_ids),
    )  # fmt: skip

    def compile_seconds(schema) -> float | None:
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        start = time.perf_counter()
        try:
            compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        except Exception:  # noqa: BLE001 - refused by XGrammar
            return None
        return time.perf_counter() - start

    return compile_seconds


def print_corpus(r: dict) -> None:
    print(f"{r['schemas']} schemas, {r['local_schemas']} without remote $refs")
    for name, e in r["engines"].items():
        pct = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in e["compile_s"].items())
        print(f"  {name:14s} pass {e['passed']:4d} ({e['passed'] / r['schemas']:.1%})  compiled {e['compiled']:4d}"
              f" (local {e['compiled_local']} = {e['compiled_local'] / max(r['local_schemas'], 1):.1%})"
              f"  invalid accepted {e['accepted_invalid']:3d} (enforced keywords: {e['accepted_invalid_enforced']})"
              f"  whole schema loosened {e['loosened_whole']}  match timeouts {e['match_timeouts']}"
              f"  convert {pct}")  # fmt: skip
        if e["unenforced"]:
            top = sorted(e["unenforced"].items(), key=lambda kv: -kv[1])[:10]
            print("    unenforced (lenient): " + ", ".join(f"{k} {n}" for k, n in top))
    names = list(r["engines"])
    print(f"  {'feature':22s} {'schemas':>7s} " + " ".join(f"{n:>13s}" for n in names) + "  (schemas passed)")
    for feature, row in sorted(r["features"].items(), key=lambda kv: -kv[1]["schemas"]):
        print(f"  {feature:22s} {row['schemas']:7d} " + " ".join(f"{row.get(n, 0):13d}" for n in names))
    if "index" in r:
        i = r["index"]
        fmt = lambda d, unit=1000, suffix=" ms": ", ".join(f"{k} {v * unit:.0f}{suffix}" for k, v in d.items())  # noqa: E731
        print(f"grammars, bundled tokenizer: {i['built']} built, {len(i['failed'])} failed")
        print(f"  spruce conversion        {fmt(i['convert_s'])} (schema -> regex)")
        print(f"  spruce compile           {fmt(i['compile_s'])} (regex -> NFA in a worker, first mask)")
        print(f"  spruce schema -> grammar {fmt(i['total_s'])} (the two, cold)")
        print(f"  spruce mask while decoding {fmt(i['mask_ms'], 1, ' ms')} (mean of the first 32 steps per schema)")
        print(f"  xgrammar compile         {fmt(i['xgrammar_s'])} ({i['xgrammar_failed']} refused)")
        for line in i["failed"]:
            print(f"    failed: {line}")
