"""Speculative decoding: --speculative-algorithm ngram (or draft) against none, same requests.

Workloads (the chat template of the model, greedy): extraction (a short document per prompt
and a JSON object of spans of it, under a JSON schema), chat (plain questions, no
constraint) and code (a snippet to repeat with one change). Each at batch 1 (one request
at a time) and batch N (--batch, that many running at once). Both engines share one copy of
the weights and run in the same process, in the order off, on, on, off per row, each warmed
up first; the outputs must be identical token for token. Where one differs in a batch, it is
decoded again alone on both engines: a difference there fails the benchmark, one only in the
batch is a numerics near-tie (`check_alone`), counted in the row's `diverged`.
The engine's --speculative-* flags (the row cost, the n-gram windows) reach the drafting one.
Reported: output tokens per second off and on, their ratio, and the share of drafted tokens
accepted.

With `--llama-cpp-bin` (a GGUF model) the batch-1 rows run on llama.cpp's llama-server too,
the same GGUF, prompts (as token ids), schema and thread count: `--spec-type ngram-simple`
(prompt lookup: a suffix of `--llama-cpp-ngram` tokens, the same number of drafts) against
none, in the same order (its decode phase as the server times it: see compare_llama_cpp).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time

from spruce.runtime.bench import write_json
from spruce.runtime.bench.llama_cpp import llama_server, server_complete

USES_ENGINE = True

FIRST = ["Harriet", "Tomasz", "Aiko", "Ngozi", "Rafael", "Ingrid", "Dev", "Lucia", "Omar"]
LAST = ["Kowalski", "Okafor", "Lindqvist", "Tanaka", "Moreau", "Haddad", "Varga", "Silva"]
TOWNS = ["Larkspur", "Brightwater", "Eastvale", "Port Morrow", "Kilnsey", "Alder Cross"]
ITEMS = ["solar inverters", "oak flooring", "lab centrifuges", "bicycle frames", "printer ink"]
SCHEMA = {
    "type": "object",
    "properties": {
        "invoice": {"type": "string"}, "customer": {"type": "string"},
        "town": {"type": "string"}, "item": {"type": "string"},
        "quantity": {"type": "integer"}, "total": {"type": "string"},
    },
    "required": ["invoice", "customer", "town", "item", "quantity", "total"],
    "additionalProperties": False,
}  # fmt: skip
QUESTIONS = [
    "Why is the sky blue?", "Give three tips for sleeping better.",
    "What is a prime number?", "Describe a cat in two sentences.",
    "How do plants make food?", "What should I pack for a beach trip?",
    "Explain what a database index is.", "Suggest a name for a bakery.",
]  # fmt: skip
SNIPPET = """def {name}(items):
    total = 0
    for item in items:
        if item.{field} > {limit}:
            total += item.{field}
    return total
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="extraction,chat,code")
    parser.add_argument("--num-prompts", type=int, default=64, help="per workload at batch N")
    parser.add_argument("--batch1-prompts", type=int, default=8, help="per workload at batch 1")
    parser.add_argument("--batch", type=int, default=16, help="requests running at once")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--algorithm", default="ngram", choices=["ngram", "draft"])
    parser.add_argument("--draft-model", default=None, help="--algorithm draft: its path")
    parser.add_argument("--llama-cpp-bin", default=None,
        help="folder of llama-server: also run the batch-1 rows on llama.cpp (GGUF models)")  # fmt: skip
    parser.add_argument("--llama-cpp-ngram", type=int, default=3,
        help="llama.cpp's lookup length (--spec-ngram-simple-size-n)")  # fmt: skip
    parser.add_argument("--llama-cpp-args", default="",
        help="more arguments for llama-server, e.g. '-nr' (no AMX repack)")  # fmt: skip
    parser.add_argument("--output-json", default=None)


def extraction(rng: random.Random) -> tuple[str, dict]:
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    invoice, town, item = f"INV-{rng.randint(1000, 9999)}", rng.choice(TOWNS), rng.choice(ITEMS)
    qty, total = rng.randint(2, 90), f"{rng.randint(100, 9999)}.{rng.randint(10, 99)} EUR"
    doc = (
        f"Invoice {invoice} was issued on 12 March to {name}, who runs a small workshop in "
        f"{town}. The order covered {qty} units of {item}, shipped in two crates. The total "
        f"due is {total}, payable within thirty days. {name.split()[0]} asked for a paper copy."
    )
    ask = "Extract invoice, customer, town, item, quantity and total from this text as JSON."
    return f"{doc}\n\n{ask}", {"json_schema": json.dumps(SCHEMA)}


def code(rng: random.Random) -> tuple[str, dict]:
    name, field = (
        rng.choice(["sum_large", "heavy_total", "big_sum"]),
        rng.choice(["price", "weight", "size"]),
    )
    text = SNIPPET.format(name=name, field=field, limit=rng.randint(5, 500))
    return f"Rewrite this function with the name `{name}_v2`, otherwise unchanged:\n\n{text}", {}


def workload(kind: str, n: int, seed: int) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    if kind == "chat":
        return [(QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS)), {}) for i in range(n)]
    return [(extraction if kind == "extraction" else code)(rng) for _ in range(n)]


def run(args: argparse.Namespace, engine_options: dict) -> int:
    from spruce.runtime.engine.offline import Engine

    options = {k: v for k, v in engine_options.items() if not k.startswith("speculative_")}
    speculative = {k: v for k, v in engine_options.items() if k.startswith("speculative_")}
    speculative.update(
        speculative_algorithm=args.algorithm, speculative_num_draft_tokens=args.draft_tokens,
        speculative_draft_model_path=args.draft_model,
    )  # fmt: skip
    off = Engine(**options, max_running_requests=args.batch)
    on = Engine(loaded=off.core.loaded, **options, **speculative, max_running_requests=args.batch)
    base = {"temperature": 0, "max_new_tokens": args.output_len}
    off.generate(input_ids=[[5, 6, 7]], sampling_params=base)  # warm-up
    with llama_cpp_servers(args, off) as servers:
        rows = compare_rows(args, off, on, base, servers)
    write_json(
        args.output_json,
        {"config": {k: v for k, v in vars(args).items() if k != "func"}, "rows": rows},
    )
    return 0


def compare_rows(args, off, on, base: dict, servers) -> list[dict]:
    rows = []
    print(f"{'engine':<10} {'workload':<11} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} "
          f"{'ratio':>6} {'accepted':>9}")  # fmt: skip
    for kind in args.workloads.split(","):
        for batch, count in ((1, args.batch1_prompts), (args.batch, args.num_prompts)):
            work = workload(kind, count, seed=len(rows))
            prompts = [chat_ids(off, text) for text, _ in work]
            params = [{**base, **extra} for _, extra in work]
            found = [("spruce", compare(off, on, prompts, params, batch))]
            if servers is not None and batch == 1:
                found.append(("llama.cpp", compare_llama_cpp(servers, prompts, params)))
            for name, row in found:
                row.update(engine=name, workload=kind, batch=batch)
                rows.append(row)
                print(f"{name:<10} {kind:<11} {batch:>5} {row['off_tok_s']:>10.1f} "
                      f"{row['on_tok_s']:>9.1f} {row['ratio']:>5.2f}x {row['acceptance']:>8.0%}")  # fmt: skip
    return rows


def chat_ids(engine, text: str) -> list[int]:
    tokenizer = engine.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(prompt, add_special_tokens=False)


def compare(off, on, prompts: list[list[int]], params: list[dict], batch: int) -> dict:
    """Both engines over the same requests (one at a time at batch 1), in the order off, on,
    on, off (drift on a shared host falls on both alike), after a warm-up of each with the
    first request (its grammar compiled); identical outputs."""
    for engine in (off, on):
        engine.generate(input_ids=prompts[0], sampling_params=params[0])
    before = on.stats()
    seconds, outputs = {id(off): 0.0, id(on): 0.0}, {}
    for engine in (off, on, on, off):
        took, outputs[id(engine)] = timed(engine, prompts, params, batch)
        seconds[id(engine)] += took
    differ = [
        i for i, (a, b) in enumerate(zip(outputs[id(off)], outputs[id(on)]))
        if a["output_ids"] != b["output_ids"]
    ]  # fmt: skip
    check_alone(off, on, prompts, params, differ)
    tokens = 2 * sum(len(o["output_ids"]) for o in outputs[id(on)])
    after = on.stats()
    drafted = after["spec_draft_tokens_total"] - before["spec_draft_tokens_total"]
    accepted = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
    off_s, on_s = seconds[id(off)], seconds[id(on)]
    return {
        "tokens": tokens // 2, "off_tok_s": tokens / off_s, "on_tok_s": tokens / on_s,
        "ratio": off_s / on_s, "acceptance": accepted / drafted if drafted else 0.0,
        "diverged": len(differ),
    }  # fmt: skip


def check_alone(off, on, prompts: list[list[int]], params: list[dict], differ: list[int]) -> None:
    """Outputs that differed in a batch are decoded again one at a time on both engines,
    their prefix caches flushed: a difference there is a bug (exit). One that holds only in
    the batch is a near-tie of the logits that fell the other way: a CPU row's logits depend
    on its step's row count (cpu_quant_ops.kernel: the integer GEMV up to its row limit, the
    float GEMM past it) and a prompt's last token computed alone takes the decode attention
    kernel, not the prefill one; drafts change both. Printed and counted (`diverged`)."""
    if not differ:
        return
    for engine in (off, on):
        engine.flush_cache()
    for i in differ:
        a, b = (e.generate(input_ids=prompts[i], sampling_params=params[i]) for e in (off, on))
        if a["output_ids"] != b["output_ids"]:
            raise SystemExit(f"speculative decoding changed the greedy output of request {i} "
                             "decoded alone: a bug")  # fmt: skip
    print(f"  {len(differ)} greedy output(s) differed in the batch but not alone (requests "
          f"{differ}): a near-tie decided by the step's row count, not by verification")  # fmt: skip


def timed(engine, prompts, params, batch: int) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    if batch == 1:
        out = [engine.generate(input_ids=p, sampling_params=s) for p, s in zip(prompts, params)]
    else:
        out = engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start, out


# -- llama.cpp on the same GGUF (llama-server, its prompt lookup) ----------------------------


@contextlib.contextmanager
def llama_cpp_servers(args: argparse.Namespace, engine):
    """(off URL, on URL): two llama-servers on the engine's GGUF, without and with
    ngram-simple drafts; None without --llama-cpp-bin."""
    path = engine.core.loaded.path
    if args.llama_cpp_bin is None or not str(path).endswith(".gguf"):
        if args.llama_cpp_bin is not None:
            print("llama.cpp comparison skipped: the model is not a GGUF file")
        yield None
        return
    threads, k = engine.config.num_threads, str(args.draft_tokens)
    ngram = ["--spec-type", "ngram-simple", "--spec-draft-n-max", k,
             "--spec-ngram-simple-size-n", str(args.llama_cpp_ngram), "--spec-ngram-simple-size-m", k]  # fmt: skip
    extra = args.llama_cpp_args
    with (
        llama_server(args.llama_cpp_bin, path, threads, [], extra) as off,
        llama_server(args.llama_cpp_bin, path, threads, ngram, extra) as on,
    ):
        yield off, on


def compare_llama_cpp(servers, prompts: list[list[int]], params: list[dict]) -> dict:
    """`compare` on llama.cpp's two servers (one request at a time, off, on, on, off): tokens
    per second of the decode phase as the server times it (its prompt's time left out, which
    favours the ratio: nothing dilutes it); acceptance from the server's draft counts. Its
    outputs with and without drafts are compared, not required to agree (`identical`)."""
    bodies = [completion_body(p, s) for p, s in zip(prompts, params)]
    for url in servers:
        server_complete(url, bodies[0])  # warm-up (the schema's grammar, the caches)
    seconds, tokens, outputs = [0.0, 0.0], [0, 0], [[], []]
    drafted = accepted = 0
    for side in (0, 1, 1, 0):
        outputs[side] = []
        for body in bodies:
            timings = (answer := server_complete(servers[side], body))["timings"]
            seconds[side] += timings["predicted_ms"] / 1000
            tokens[side] += timings["predicted_n"]
            drafted += timings.get("draft_n", 0)
            accepted += timings.get("draft_n_accepted", 0)
            outputs[side].append(answer["content"])
    identical = sum(a == b for a, b in zip(*outputs))
    return {
        "tokens": tokens[1] // 2, "off_tok_s": tokens[0] / seconds[0], "on_tok_s": tokens[1] / seconds[1],
        "ratio": (tokens[1] / seconds[1]) / (tokens[0] / seconds[0]),
        "acceptance": accepted / drafted if drafted else 0.0, "identical": f"{identical}/{len(bodies)}",
    }  # fmt: skip


def completion_body(prompt: list[int], params: dict) -> dict:
    """llama-server's /completion body for a Spruce request: greedy, the same length cap
    and schema, no prompt cache (only the decode phase is timed)."""
    body = {"prompt": prompt, "n_predict": params["max_new_tokens"], "temperature": 0,
            "top_k": 1, "cache_prompt": False}  # fmt: skip
    if "json_schema" in params:
        body["json_schema"] = json.loads(params["json_schema"])
    return body
