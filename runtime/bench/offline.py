"""Offline throughput: N requests through the Engine (optionally vs transformers).

Prints requests/s, input and output tokens/s, the mean decode-step time at the largest
batch, that step against the model's bare matrix multiplications for the batch (measured in
pairs, see step_over_matmuls), batch-1 decode tokens/s and the prefill tokens/s of one long
prompt (means of 5 runs). `--compare hf` runs the same
requests through transformers' batched `generate` in the same process and prints the ratio.
`--model-shape 1b|8b --quant Q4_0|Q4_K|...` runs on random weights in a real model's shape
(bench/shapes.py: written into the cache when missing), at an 8192-token context.
`--compare llama.cpp` runs llama.cpp's `llama-bench` (tg128 at 1 and N threads and after a
4096-token prompt, pp512) and `llama-batched-bench` (16 and 64 sequences of 128 prompt + 128
generated tokens) on the same GGUF file and threads (`--llama-cpp-args` adds arguments, e.g.
`-nr`), runs the same workloads through Spruce, and prints the ratios in one table with the
thread wait policy in use; the batch-1 and prefill rows are the median of `--compare-rounds`
rounds that run both engines back to back (bench.alternating_rounds), and Spruce's batch-1
is also timed there with one decode step a call. It also measures the memory bandwidth
(bench/bandwidth.py) and prints batch-1 decode as a share of it. Without the binaries (on
PATH or in --llama-cpp-bin) it says so and skips them.
`--breakdown` times the parts of a batch-1 decode step (matmuls, attention, norms, other
model ops, the runner, sampling, the scheduler). `--plot FILE.png` draws output tokens/s
against parallel sequences (1, 4, 16, 64 x (128 + 128) tokens) for Spruce, llama.cpp
(llama-batched-bench, when found) and transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from spruce.runtime.bench import alternating_rounds, write_json
from spruce.runtime.bench.bandwidth import print_bandwidth
from spruce.runtime.bench.breakdown import (
    bare_matmul_seconds,
    one_step_a_call,
    print_breakdown,
    step_breakdown,
    step_over_matmuls,
)
from spruce.runtime.bench.llama_cpp import (
    PARALLEL,
    llama_batched,
    llama_cpp_tools,
    llama_depth,
    llama_singles,
    run_llama_cpp,
    table_rows,
)
from spruce.runtime.bench.plot import PLOT_COUNTS, plot_scaling
from spruce.runtime.bench.shapes import add_shape_arguments, model_file
from spruce.runtime.config import wait_policy
from spruce.runtime.errors import SpruceError

USES_ENGINE = True
# --model-shape's context (unless --context-length is given): the files advertise their
# models' 131072 tokens, and the KV pool must hold one whole context; the rows need 4096 + 129
SHAPE_CONTEXT = 8192


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-min", type=int, default=64)
    parser.add_argument("--input-len-max", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128, help="max_new_tokens per request")
    parser.add_argument(
        "--dataset", default=None, help="JSONL file with a 'prompt' (text) per line"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="always generate --output-len tokens"
    )
    parser.add_argument("--compare", choices=["hf", "llama.cpp"], default=None)
    parser.add_argument("--llama-cpp-bin", default=None,
        help="folder of llama-bench / llama-batched-bench (default: PATH)")  # fmt: skip
    parser.add_argument("--compare-rounds", type=int, default=3,
        help="--compare llama.cpp: rounds of the batch-1 rows (median)")  # fmt: skip
    parser.add_argument("--compare-parallel", default="16,64",
        help="--compare llama.cpp: parallel sequence counts of the batched rows ('' for none)")  # fmt: skip
    parser.add_argument("--compare-repetitions", type=int, default=5,
        help="--compare llama.cpp: runs averaged per batch-1 / prefill figure, each engine")  # fmt: skip
    parser.add_argument("--compare-depth", action=argparse.BooleanOptionalAction, default=True,
        help="--compare llama.cpp: the batch-1 row after a 4096-token prompt")  # fmt: skip
    parser.add_argument("--llama-cpp-args", default="",
        help="more arguments for llama.cpp's tools, e.g. '-nr' (no AMX repack)")  # fmt: skip
    parser.add_argument(
        "--hf-batch-size", type=int, default=None, help="default: all prompts in one batch"
    )
    parser.add_argument(
        "--skip-single", action="store_true", help="skip the batch-1 and long-prefill probes"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="time the parts of a batch-1 decode step"
    )
    parser.add_argument(
        "--plot", default=None, metavar="FILE.png", help="chart tokens/s vs parallel sequences"
    )
    parser.add_argument("--output-json", default=None)
    add_shape_arguments(parser)


def synthetic_prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """Seeded random token ids (no special tokens) of random lengths in [lo, hi]."""
    rng = random.Random(seed)
    allowed = [i for i in range(tokenizer.vocab_size) if i not in tokenizer.special_token_ids]
    return [[rng.choice(allowed) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def dataset_prompts(tokenizer, path: str, n: int) -> list[list[int]]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [tokenizer.encode(r["prompt"]) for r in rows[:n]]


def mean_decode_step(steps) -> tuple[float, int]:
    """Mean seconds of the all-decode steps at the largest batch size seen, and that size."""
    decode = [st for st in steps if st.all_decode]
    if not decode:
        return 0.0, 0
    top = max(st.batch_size for st in decode)
    times = [st.seconds for st in decode if st.batch_size == top]
    return sum(times) / len(times), top


def run_engine(engine, prompts: list[list[int]], params: dict) -> dict:
    engine.core.step_log = []
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    step_s, step_batch = mean_decode_step(engine.core.step_log)
    engine.core.step_log = None
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o["output_ids"]) for o in outs)
    return {
        "seconds": seconds,
        "requests_per_s": len(prompts) / seconds,
        "input_tokens_per_s": n_in / seconds,
        "output_tokens_per_s": n_out / seconds,
        "output_tokens": n_out,
        "decode_step_ms": step_s * 1e3,
        "decode_step_batch": step_batch,
        "outputs": [o["output_ids"] for o in outs],
    }


DECODE_STEPS = 128  # the batch-1 probe's decode steps (llama-bench's tg128)


def single_probes(engine, tokenizer, repetitions: int = 5, with_prefill: bool = True) -> dict:
    """Prefill tokens/s of one 512-token prompt (unless not `with_prefill`) and batch-1
    decode tokens/s: each the mean over `repetitions` runs after a warm-up, as llama-bench
    reports its pp512 / tg128 (one run alone moved by 30% on a busy host). Decode is 128
    decode steps after a 16-token prompt, timed as generating 129 tokens less generating 1
    (both from an empty cache), so the prompt's prefill and the request's setup fall out, as
    tg128 times decoding alone."""
    prompt = synthetic_prompts(tokenizer, 1, 512, 512, seed=123)[0]
    short = synthetic_prompts(tokenizer, 1, 16, 16, seed=7)[0]

    def generate(ids: list[int], tokens: int) -> float:
        engine.flush_cache()  # the whole prompt computed, none of it from the cache
        params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params=params)
        return time.perf_counter() - start

    def prefill() -> float:
        return 512 / generate(prompt, 1)

    def decode() -> float:
        return DECODE_STEPS / (generate(short, DECODE_STEPS + 1) - generate(short, 1))

    rates, probes = {}, [("batch1_decode_tokens_per_s", decode)]
    if with_prefill:
        probes.insert(0, ("prefill_512_tokens_per_s", prefill))
    for name, probe in probes:
        probe()  # warm-up
        rates[name] = statistics.mean(probe() for _ in range(repetitions))
    return rates


def run_hf(
    loaded, prompts: list[list[int]], max_new_tokens: int, batch_size: int, ignore_eos: bool
) -> dict:
    """transformers' batched generate on the same weights: left padding, greedy."""
    return hf_generate(
        hf_model_from(loaded), loaded, prompts, max_new_tokens, batch_size, ignore_eos
    )


def hf_generate(
    model, loaded, prompts: list[list[int]], max_new_tokens: int, batch_size: int, ignore_eos: bool
) -> dict:
    pad = 0
    eos = None if ignore_eos else sorted(loaded.tokenizer.eos_token_ids)
    start = time.perf_counter()
    n_out = 0
    outputs = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
                min_new_tokens=max_new_tokens if ignore_eos else 0,
            )
        for row in gen[:, width:].tolist():
            row = _until_eos(row, eos)
            outputs.append(row)
            n_out += len(row)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens_per_s": n_out / seconds, "output_tokens": n_out,
            "outputs": outputs}  # fmt: skip


def _until_eos(row: list[int], eos: list[int] | None) -> list[int]:
    if not eos:
        return row
    for j, t in enumerate(row):
        if t in eos:
            return row[: j + 1]
    return row


def hf_model_from(loaded):
    """A transformers model holding exactly the weights Spruce runs (fp32)."""
    import transformers

    from spruce.runtime.models.loading.loader import read_checkpoint

    hf_config, state_dict, _ = read_checkpoint(loaded.path, torch.float32)
    config = transformers.AutoConfig.for_model(
        **{**hf_config, "model_type": hf_config.get("model_type", "llama")}
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state_dict, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def run(args: argparse.Namespace, engine_options: dict) -> int:
    from spruce.runtime.config import EngineConfig
    from spruce.runtime.engine.offline import Engine
    from spruce.runtime.models.loading.loader import load_model

    if args.model_shape:
        if "model_path" in engine_options:
            raise SpruceError("give --model or --model-shape, not both")
        path = model_file(args.model_shape, args.quant)
        engine_options = {"context_length": SHAPE_CONTEXT} | engine_options | {"model_path": path}
    config = EngineConfig.from_options(**engine_options)
    model = config.model
    loaded = load_model(
        model.model_path, config.resolved_dtype, config.resolved_device, model.quantization
    )
    engine = Engine(**engine_options, loaded=loaded)
    tokenizer = engine.tokenizer
    if args.dataset:
        prompts = dataset_prompts(tokenizer, args.dataset, args.num_prompts)
    else:
        prompts = synthetic_prompts(
            tokenizer, args.num_prompts, args.input_len_min, args.input_len_max
        )
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": args.ignore_eos}
    engine.generate(
        input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4}
    )  # warm-up
    engine.flush_cache()
    spruce = run_engine(engine, prompts, params)
    result = {"config": vars(args) | {"func": None}, "spruce": _public(spruce)}
    result.update(step_over_matmuls(engine, prompts, params))
    if not args.skip_single:
        result.update(single_probes(engine, tokenizer))
    if args.compare == "llama.cpp":
        compare_llama_cpp(engine, args, result)
    if args.breakdown:
        result["breakdown"] = measure_breakdown(engine, tokenizer)
    if args.plot:
        result["scaling"] = scaling_curves(engine, args)
        title = f"{os.path.basename(loaded.path)}, {engine.config.num_threads} threads"
        plot_scaling(result["scaling"], args.plot, title)
    if args.compare == "hf":
        hf = run_hf(engine.core.loaded, prompts, args.output_len,
                    args.hf_batch_size or len(prompts), args.ignore_eos)  # fmt: skip
        result["hf"] = _public(hf)
        result["speedup_vs_hf"] = spruce["output_tokens_per_s"] / hf["output_tokens_per_s"]
        same = sum(a == b for a, b in zip(spruce["outputs"], hf["outputs"]))
        result["identical_outputs_vs_hf"] = f"{same}/{len(prompts)}"
    print_report(result)
    write_json(args.output_json, result)
    return 0


def _public(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "outputs"}


def print_report(r: dict) -> None:
    s = r["spruce"]
    print(f"requests/s            {s['requests_per_s']:.3f}")
    print(f"input tokens/s        {s['input_tokens_per_s']:.1f}")
    print(f"output tokens/s       {s['output_tokens_per_s']:.1f}  ({s['output_tokens']} tokens)")
    print(f"decode step           {s['decode_step_ms']:.1f} ms at batch {s['decode_step_batch']}")
    if "pairs" in r:
        print(
            f"step vs bare matmuls  {r['paired_step_ms']:.1f} / {r['bare_matmul_ms']:.1f} ms at batch {r['paired_batch']} "
            f"= {r['decode_step_over_matmul']:.2f}x (medians of {r['pairs']} pairs, each step followed by the matmuls)"
        )
    if "batch1_decode_tokens_per_s" in r:
        print(f"batch-1 decode        {r['batch1_decode_tokens_per_s']:.1f} tokens/s")
        print(f"prefill (512 tokens)  {r['prefill_512_tokens_per_s']:.1f} tokens/s")
    if "breakdown" in r:
        print_breakdown(r["breakdown"])
    if "scaling" in r:
        print("output tokens/s by parallel sequences (128 + 128 tokens each):")
        for name, curve in r["scaling"].items():
            print(f"  {name:13s} " + "  ".join(f"{n}: {v:.1f}" for n, v in curve.items()))
    if "hf" in r:
        print(f"transformers output   {r['hf']['output_tokens_per_s']:.1f} tokens/s")
        print(
            f"speedup vs hf         {r['speedup_vs_hf']:.2f}x (identical outputs: {r['identical_outputs_vs_hf']})"
        )


# -- llama.cpp on the same GGUF file (its tools: bench/llama_cpp.py) ------------------------


def spruce_parallel(engine, tokenizer, counts=PARALLEL) -> dict[str, float]:
    """The llama-batched-bench workload through Spruce: decode-phase and end-to-end tokens/s."""
    out = {}
    params = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    for count in counts:
        engine.flush_cache()
        r = run_engine(engine, synthetic_prompts(tokenizer, count, 128, 128, seed=count), params)
        out[f"decode_{count}"] = r["decode_step_batch"] / (r["decode_step_ms"] / 1e3)
        out[f"end_to_end_{count}"] = r["output_tokens_per_s"]
    return out


def fixed_thread_probes(
    engine, tokenizer, threads: int, with_prefill: bool = True, repetitions: int = 5
) -> dict:
    """single_probes with torch (and the C kernels) on `threads` threads, as llama-bench's
    -t sets its own."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return single_probes(engine, tokenizer, repetitions, with_prefill)
    finally:
        torch.set_num_threads(before)


def spruce_singles(engine, tokenizer, threads: int, repetitions: int = 5) -> dict[str, float]:
    """Spruce's side of a round against `llama_singles`: batch-1 decode at 1 and `threads`
    threads, prefill at `threads`; and batch-1 decode at `threads` with one decode step a
    call (`tg128_one_step`: the same engine without multi-step decode calls)."""
    one = fixed_thread_probes(engine, tokenizer, 1, False, repetitions)
    most = fixed_thread_probes(engine, tokenizer, threads, True, repetitions)
    with one_step_a_call(engine):
        single = fixed_thread_probes(engine, tokenizer, threads, False, repetitions)
    return {
        "tg128_t1": one["batch1_decode_tokens_per_s"],
        "tg128": most["batch1_decode_tokens_per_s"],
        "pp512": most["prefill_512_tokens_per_s"],
        "tg128_one_step": single["batch1_decode_tokens_per_s"],
    }


def medians(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def compare_llama_cpp(engine, args: argparse.Namespace, result: dict) -> None:
    tools, path = llama_cpp_tools(args.llama_cpp_bin), engine.core.loaded.path
    if tools is None or not path.endswith(".gguf"):
        why = ("llama-bench / llama-batched-bench not found" if tools is None
               else "the model is not a GGUF file")  # fmt: skip
        print(f"llama.cpp comparison skipped: {why} (see --llama-cpp-bin)")
        return
    threads, tokenizer = engine.config.num_threads, engine.tokenizer
    counts = [int(n) for n in args.compare_parallel.split(",") if n.strip()]
    ours = spruce_parallel(engine, tokenizer, counts)
    theirs = run_llama_cpp(tools, path, [1, threads], args.llama_cpp_args, counts)
    ours_runs, theirs_runs = alternating_rounds(
        lambda: spruce_singles(engine, tokenizer, threads, args.compare_repetitions),
        lambda: llama_singles(
            tools[0], path, [1, threads], args.llama_cpp_args, args.compare_repetitions
        ),
        args.compare_rounds,
    )
    ours, theirs = ours | medians(ours_runs), theirs | medians(theirs_runs)
    if args.compare_depth:
        ours["tg128_d4096"] = depth_decode(engine, tokenizer)
        theirs["tg128_d4096"] = llama_depth(tools[0], path, threads, DEPTH, args.llama_cpp_args)
    steps = engine.core.scheduler.decode_steps
    result["llama_cpp"] = {"spruce": ours, "llama.cpp": theirs, "wait_policy": wait_policy(),
                           "decode_steps": steps}  # fmt: skip
    result["llama_cpp"]["batch1_rounds"] = {"spruce": ours_runs, "llama.cpp": theirs_runs}
    print(f"\nthread wait policy: {wait_policy()}")
    print(
        f"greedy decode steps per call, at most: {steps} (--decode-steps); batch-1 at "
        f"{threads} threads with one a call: {ours['tg128_one_step']:.1f} tokens/s, so "
        f"{ours['tg128'] / ours['tg128_one_step']:.2f}x from the multi-step calls"
    )
    print(
        f"batch-1 and prefill rows: the median of {args.compare_rounds} rounds, the engines "
        "back to back"
    )
    for key in ("tg128_t1", "tg128", "pp512"):
        rates = [", ".join(f"{run[key]:.1f}" for run in runs) for runs in (ours_runs, theirs_runs)]
        print(f"  {key} by round: Spruce {rates[0]}; llama.cpp {rates[1]}")
    print("| workload (same GGUF), tokens/s | llama.cpp | Spruce | Spruce / llama.cpp |")
    print("| --- | --- | --- | --- |")
    for key, label in table_rows(threads, counts):
        if key in theirs and key in ours:
            print(
                f"| {label} | {theirs[key]:.1f} | {ours[key]:.1f} | {ours[key] / theirs[key]:.2f}x |"
            )
    result["llama_cpp"]["bandwidth"] = print_bandwidth(
        path, threads, ours["tg128"], theirs["tg128"]
    )


DEPTH = 4096  # the long-context row: batch-1 decode after a prompt this long


def depth_decode(engine, tokenizer, repetitions: int = 2) -> float:
    """Batch-1 decode tokens/s after a DEPTH-token prompt, as llama-bench's tg128 at -d 4096:
    the decode steps' own seconds (the step log), the mean of `repetitions` generations of
    DECODE_STEPS tokens; after the first, the prompt comes from the prefix cache."""
    prompt = synthetic_prompts(tokenizer, 1, DEPTH, DEPTH, seed=DEPTH)
    params = {"max_new_tokens": DECODE_STEPS + 1, "temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    rates = []
    for _ in range(repetitions):
        engine.core.step_log = []
        engine.generate(input_ids=prompt, sampling_params=params)
        steps = [step for step in engine.core.step_log if step.all_decode]
        engine.core.step_log = None
        rates.append(sum(s.steps for s in steps) / sum(s.seconds * s.steps for s in steps))
    return statistics.mean(rates)


def measure_breakdown(engine, tokenizer, new_tokens: int = 64) -> dict:
    """The timed parts of a batch-1 decode step (breakdown.py), the same step untimed, and
    the linear layers alone at batch 1."""
    prompt = synthetic_prompts(tokenizer, 1, 16, 16, seed=7)[0]
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    plain_ms = run_engine(engine, [prompt], params)["decode_step_ms"]
    parts = step_breakdown(engine, prompt, params)
    # the least of a few runs: one slow run (a busy machine) would exceed the whole step
    bare_ms = (
        min(bare_matmul_seconds(engine.core.runner.model, 1, repeats=2) for _ in range(5)) * 1e3
    )
    return {**parts, "plain_step_ms": plain_ms, "bare_matmul_ms": bare_ms}


# ---------------------------------------------------------------------------------------
# Output tokens/s against parallel sequences, as a chart
# ---------------------------------------------------------------------------------------


def scaling_curves(engine, args: argparse.Namespace) -> dict[str, dict[int, float]]:
    """Output tokens/s end to end (generated tokens over the whole run) for `count`
    sequences of 128 prompt + 128 generated tokens: Spruce, transformers (batched generate
    on the same weights in float32) and llama.cpp's llama-batched-bench when found."""
    loaded, tokenizer = engine.core.loaded, engine.tokenizer
    params = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    hf_model = hf_model_from(loaded)
    curves: dict[str, dict[int, float]] = {"Spruce": {}, "transformers": {}}
    for count in PLOT_COUNTS:
        prompts = synthetic_prompts(tokenizer, count, 128, 128, seed=count)
        engine.flush_cache()
        curves["Spruce"][count] = run_engine(engine, prompts, params)["output_tokens_per_s"]
        hf = hf_generate(hf_model, loaded, prompts, 128, count, ignore_eos=True)
        curves["transformers"][count] = hf["output_tokens_per_s"]
    tools = llama_cpp_tools(args.llama_cpp_bin)
    if tools is not None and loaded.path.endswith(".gguf"):
        theirs = llama_batched(tools[1], loaded.path, engine.config.num_threads, PLOT_COUNTS)
        curves["llama.cpp"] = {count: theirs[f"end_to_end_{count}"] for count in PLOT_COUNTS}
    else:
        print(
            "llama.cpp left out of the plot: llama-batched-bench not found or the model is not a GGUF file"
        )
    return curves
