"""Prefix sharing: the radix cache vs --disable-radix-cache on the same requests.

Workloads: few-shot (K prefixes of ~L tokens x M questions each, arriving shuffled),
multi-turn chat (C conversations x T turns, each turn re-sending the whole history and the
model's own answers), a tree (one long prefix, many short continuations), and all-unique
prompts (the cache's cost when nothing is shared). For each: throughput and hit rate with
the cache and without, their ratio, and the hit rate as a share of the best possible.
Both engines share one copy of the weights and run in the same process.

`--dp N`: instead, the workloads through Engine(dp_size=N) (N EngineCores, each with its
own KV pool and radix cache, stepped in turn in this process) routed cache-aware and
round-robin, next to one core: hit rate and throughput side by side. On a CPU the cores
share the machine, so the figure that matters is the hit rate a server's replicas would get.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from spruce.runtime.bench import write_json

USES_ENGINE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="few-shot,multi-turn,tree,unique")
    parser.add_argument("--num-prefixes", type=int, default=4, help="few-shot: K")
    parser.add_argument("--prefix-len", type=int, default=1000, help="few-shot and tree: L")
    parser.add_argument("--questions", type=int, default=16, help="few-shot: M per prefix")
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--conversations", type=int, default=8, help="multi-turn: C")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: T")
    parser.add_argument("--branches", type=int, default=32, help="tree: continuations")
    parser.add_argument(
        "--unique", type=int, default=32, help="unique: prompts of --prefix-len/2 tokens"
    )
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per side, in A-B-B-A order; the mean is reported",
    )
    parser.add_argument(
        "--policies",
        default=None,
        help="also run few-shot with each of these policies, e.g. fcfs,lpm,dfs-weight",
    )
    parser.add_argument(
        "--dp", type=int, default=1, help="N cores, cache-aware vs round-robin vs one"
    )
    parser.add_argument("--output-json", default=None)


@dataclass
class Workload:
    name: str
    rounds: list[list[list[int]]]  # requests sent together; multi-turn builds later rounds itself
    best_cached: int  # the most prompt tokens a perfect cache could serve


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def few_shot(args, vocab: int, rng: random.Random) -> Workload:
    prefixes = [ids(rng, args.prefix_len, vocab) for _ in range(args.num_prefixes)]
    requests = [
        p + ids(rng, args.question_len, vocab) for p in prefixes for _ in range(args.questions)
    ]
    rng.shuffle(requests)
    best = args.num_prefixes * (args.questions - 1) * args.prefix_len
    return Workload("few-shot", [requests], best)


def tree(args, vocab: int, rng: random.Random) -> Workload:
    trunk = ids(rng, args.prefix_len, vocab)
    requests = [trunk + ids(rng, args.question_len, vocab) for _ in range(args.branches)]
    return Workload("tree", [requests], (args.branches - 1) * args.prefix_len)


def unique(args, vocab: int, rng: random.Random) -> Workload:
    return Workload(
        "unique", [[ids(rng, args.prefix_len // 2, vocab) for _ in range(args.unique)]], 0
    )


def run_rounds(engine, work: Workload, params: dict) -> tuple[int, int]:
    """Runs the workload; returns (output tokens, prompt tokens)."""
    n_out = n_in = 0
    for requests in work.rounds:
        outs = engine.generate(input_ids=requests, sampling_params=params)
        n_out += sum(len(o["output_ids"]) for o in outs)
        n_in += sum(len(r) for r in requests)
    return n_out, n_in


def run_multi_turn(engine, args, vocab: int, params: dict) -> tuple[int, int, int]:
    """Each turn re-sends history + the model's answer + a new user message. Returns
    (output tokens, prompt tokens, best possible cached tokens)."""
    rng = random.Random(1)
    histories = [ids(rng, args.question_len * 4, vocab) for _ in range(args.conversations)]
    n_out = n_in = best = 0
    for turn in range(args.turns):
        outs = engine.generate(input_ids=histories, sampling_params=params)
        n_in += sum(len(h) for h in histories)
        n_out += sum(len(o["output_ids"]) for o in outs)
        if turn:
            best += sum(len(h) - args.question_len for h in histories)
        histories = [
            h + o["output_ids"] + ids(rng, args.question_len, vocab)
            for h, o in zip(histories, outs)
        ]
    return n_out, n_in, best


def measure(engine, name: str, args, vocab: int, params: dict) -> dict:
    engine.flush_cache()
    before = engine.stats()
    start = time.perf_counter()
    if name == "multi-turn":
        n_out, n_in, best = run_multi_turn(engine, args, vocab, params)
    else:
        work = WORKLOADS[name](args, vocab, random.Random(0))
        (n_out, n_in), best = run_rounds(engine, work, params), work.best_cached
    seconds = time.perf_counter() - start
    after = engine.stats()
    cached = after["cached_prompt_tokens_total"] - before["cached_prompt_tokens_total"]
    return {
        "seconds": seconds,
        "output_tokens_per_s": n_out / seconds,
        "prompt_tokens_per_s": n_in / seconds,
        "hit_rate": cached / max(n_in, 1),
        "best_hit_rate": best / max(n_in, 1),
    }


def measure_both(
    with_cache, without, name: str, args, vocab: int, params: dict
) -> tuple[dict, dict]:
    """Alternates the sides (A B B A ...) so that drift on a shared machine favours neither."""
    runs = {"on": [], "off": []}
    for i in range(args.repeats):
        order = [("on", with_cache), ("off", without)]
        for side, engine in order if i % 2 == 0 else order[::-1]:
            runs[side].append(measure(engine, name, args, vocab, params))
    return _mean(runs["on"]), _mean(runs["off"])


def _mean(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


WORKLOADS = {"few-shot": few_shot, "tree": tree, "unique": unique}


def run(args: argparse.Namespace, engine_options: dict) -> int:
    from spruce.runtime.engine.offline import Engine

    options = dict(engine_options)
    options.pop("disable_radix_cache", None)
    with_cache = Engine(**options)
    without = Engine(loaded=with_cache.core.loaded, **options, disable_radix_cache=True)
    vocab = with_cache.tokenizer.vocab_size - 256  # stay clear of special tokens at the end
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    with_cache.generate(input_ids=[[5, 6, 7]], sampling_params=params)  # warm-up
    if args.dp > 1:
        results = {"dp": compare_dp(args, options, with_cache, vocab, params)}
        write_json(
            args.output_json,
            {"config": {k: v for k, v in vars(args).items() if k != "func"}, "results": results},
        )
        return 0
    results = {}
    for name in args.workloads.split(","):
        on, off = measure_both(with_cache, without, name, args, vocab, params)
        results[name] = {"cache": on, "no_cache": off, "speedup": off["seconds"] / on["seconds"]}
        print_row(name, results[name])
    if args.policies:
        results["policies"] = compare_policies(args, options, with_cache, vocab, params)
    write_json(
        args.output_json,
        {"config": {k: v for k, v in vars(args).items() if k != "func"}, "results": results},
    )
    return 0


def compare_policies(args, options: dict, base, vocab: int, params: dict) -> dict:
    out = {}
    for policy in args.policies.split(","):
        engine = base if policy == base.config.scheduler.schedule_policy else None
        engine = engine or type(base)(
            loaded=base.core.loaded, **{**options, "schedule_policy": policy}
        )
        out[policy] = measure(engine, "few-shot", args, vocab, params)
        print(
            f"  policy {policy:10s} few-shot {out[policy]['output_tokens_per_s']:8.1f} out tok/s  hit {out[policy]['hit_rate']:.3f}"
        )
    return out


def compare_dp(args, options: dict, single, vocab: int, params: dict) -> dict:
    """Each workload through one core, then N cores routed cache-aware and round-robin."""
    from spruce.runtime.scheduler.router import make_router

    engines = {"dp 1": single}
    for policy in ("cache-aware", "round-robin"):
        router = make_router(policy, args.dp)
        engines[f"dp {args.dp} {policy}"] = type(single)(
            loaded=single.core.loaded, dp_size=args.dp, router=router, **options
        )
    out = {}
    for name in args.workloads.split(","):
        out[name] = {label: measure(e, name, args, vocab, params) for label, e in engines.items()}
        for label, r in out[name].items():
            print(
                f"{name:10s} {label:24s} {r['output_tokens_per_s']:8.1f} out tok/s  "
                f"{r['prompt_tokens_per_s']:8.1f} prompt tok/s  "
                f"hit {r['hit_rate']:.3f} (best {r['best_hit_rate']:.3f})"
            )
    for engine in engines.values():
        if engine is not single:
            engine.shutdown()
    return out


def print_row(name: str, r: dict) -> None:
    on, off = r["cache"], r["no_cache"]
    share = on["hit_rate"] / on["best_hit_rate"] if on["best_hit_rate"] else float("nan")
    print(
        f"{name:10s} cache {on['output_tokens_per_s']:8.1f} out tok/s  no-cache {off['output_tokens_per_s']:8.1f}"
        f"  ratio {r['speedup']:.2f}x  hit {on['hit_rate']:.3f} (best {on['best_hit_rate']:.3f}, {share:.0%} of best)"
    )
