"""Structured output: JSON-schema requests with jump-forward on vs off in the same run.

Fills the schemas of a folder (default: tests/data/schemas, the shared set) on the model,
greedy, chat-formatted; reports model forward passes, output tokens/s, mean latency, the
mask cost (bitmask fill + apply per step, as a share of the decode step) and each schema's
compile time, cold and cached. Both engines share one copy of the weights.
"""

from __future__ import annotations

import argparse
import json
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
        help="folder of {schema, valid, invalid} files: the same as `spruce bench grammar --corpus DIR` "
        "(pass rates and per-token mask cost of every grammar engine); no model run",
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


def requests(
    engine, schemas: dict[str, dict], n: int, max_new: int
) -> tuple[list[str], list[dict]]:
    names = [list(schemas)[i % len(schemas)] for i in range(n)]
    prompts = [
        engine.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Give example {i + 1} of a {name.replace('_', ' ')} as JSON.",
                }
            ]
        )
        for i, name in enumerate(names)
    ]
    params = [
        {"json_schema": schemas[name], "temperature": 0, "max_new_tokens": max_new}
        for name in names
    ]
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
        out[name] = {
            "cold_s": cold,
            "cached_us": (time.perf_counter() - start) * 1e6,
            "fields": _fields(schema),
        }
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
        passes += sum(st.steps for st in core.step_log)
        latency += out["meta_info"]["e2e_latency"]
        jumped += out["meta_info"]["jump_forward_tokens"]
        texts.append(out["text"])
    core.step_log = None
    return {
        "forward_passes": passes,
        "mean_latency_s": latency / len(prompts),
        "jump_forward_tokens": jumped,
        "texts": texts,
    }


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
        from spruce.runtime.bench import grammar_bench

        return grammar_bench.run(argparse.Namespace(corpus=args.corpus, kind="json_schema", engines=None, limit=None,
                                                    output_json=args.output_json))  # fmt: skip
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
    print(
        f"forward passes cut {r['forward_pass_ratio']:.2f}x, latency cut {r['latency_ratio']:.2f}x, "
        f"identical texts {r['identical_texts']}/{n}, jump-forwarded tokens {a['jump_forward_tokens']}"
    )
    print(
        f"mask fill+apply {b['mask_ms_per_step']:.2f} ms per step = {r['mask_share_of_decode_step']:.1%} of a decode step"
        f" ({b['decode_step_ms']:.1f} ms at batch {b['batch']})"
    )
    for name, c in r["compile"].items():
        print(
            f"  compile {name:16s} {c['fields']:2d} fields  cold {c['cold_s'] * 1e3:7.1f} ms  cached {c['cached_us']:6.1f} us"
        )
