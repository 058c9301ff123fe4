"""Few-shot QA as one run_batch vs the same programs one at a time with no prefix cache.

    python -m spruce.lang.bench [--num-programs 64] [--num-shots 24] [--model PATH] [--num-threads N]

Both sides run the same program (a long few-shot prefix, then the question and a short
greedy answer) on the same model, each on its own `spruce serve` started here:
  spruce    run_batch: the common prefix is sent once as a hint, then the programs run
            concurrently and the runtime batches them, sharing the prefix's KV cache;
  baseline  one program after another, no prefix hint, runtime started with
            --disable-radix-cache (every prompt is computed in full).
Prints each side's seconds and the ratio baseline / spruce.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import spruce.lang as sl

TOPICS = ["plus", "minus", "times"]


def arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice(TOPICS)
    value = {"plus": a + b, "minus": a - b, "times": a * b}[op]
    return f"What is {a} {op} {b}?", str(value)


def few_shot_prefix(num_shots: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    shots = [arithmetic(rng) for _ in range(num_shots)]
    body = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in shots)
    return "Answer each arithmetic question with a number only.\n\n" + body


def make_program(prefix: str, max_tokens: int) -> sl.Program:
    @sl.function
    def few_shot_qa(s, question):
        s += prefix + "Question: " + question + "\nAnswer:"
        s += sl.gen("answer", max_tokens=max_tokens, stop="\n")

    return few_shot_qa


def run_spruce(program: sl.Program, backend: Any, questions: list[str]) -> list[sl.ProgramState]:
    return program.run_batch([{"question": q} for q in questions], backend=backend, temperature=0)


def run_baseline(program: sl.Program, backend: Any, questions: list[str]) -> list[sl.ProgramState]:
    return [program.run(question=q, backend=backend, temperature=0) for q in questions]


def measure(
    args: argparse.Namespace, runner, program: sl.Program, questions: list[str], **options: Any
):
    """(seconds, answers, prompt tokens of one program) on a fresh runtime with `options`."""
    if args.quantization is not None:
        options["quantization"] = args.quantization
    with sl.Runtime(
        args.model, num_threads=args.num_threads, kv_memory_gb=args.kv_memory_gb, **options
    ) as rt:
        program.run(question="What is 1 plus 1?", backend=rt)  # warm-up: first-call costs
        sl.flush_cache(rt)  # ... but no head start from the cache
        start = time.perf_counter()
        states = runner(program, rt, questions)
        seconds = time.perf_counter() - start
    failed = [s.error() for s in states if not s.ok]
    if failed:
        raise SystemExit(f"{len(failed)} programs failed, e.g.: {failed[0]}")
    prompt_tokens = states[0].get_meta_info("answer")["prompt_tokens"]
    return seconds, [s["answer"].strip() for s in states], prompt_tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m spruce.lang.bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--num-programs", type=int, default=64)
    parser.add_argument(
        "--num-shots", type=int, default=24, help="few-shot examples in the shared prefix"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=8, help="answer length (greedy, stops at a newline)"
    )
    parser.add_argument(
        "--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch CPU threads of each runtime"
    )
    parser.add_argument("--kv-memory-gb", type=float, default=1.0)
    parser.add_argument(
        "--quantization", default=None, help="weights in memory (default: the runtime's, auto)"
    )
    args = parser.parse_args(argv)

    program = make_program(few_shot_prefix(args.num_shots), args.max_tokens)
    rng = random.Random(1)
    questions = [arithmetic(rng)[0] for _ in range(args.num_programs)]
    fast, fast_answers, prompt_tokens = measure(args, run_spruce, program, questions)
    slow, slow_answers, _ = measure(
        args, run_baseline, program, questions, disable_radix_cache=True
    )
    same = sum(a == b for a, b in zip(fast_answers, slow_answers))
    print(f"few-shot QA: {args.num_programs} programs, ~{prompt_tokens} prompt tokens each, "
          f"{args.num_shots} shots, answers of <= {args.max_tokens} tokens")  # fmt: skip
    n = args.num_programs
    print(
        f"  spruce   run_batch + prefix hint + radix cache   {fast:8.2f} s  {n / fast:7.2f} programs/s"
    )
    print(
        f"  baseline one at a time, --disable-radix-cache     {slow:8.2f} s  {n / slow:7.2f} programs/s"
    )
    print(f"  speedup  {slow / fast:.1f}x   (identical answers: {same}/{args.num_programs})")


if __name__ == "__main__":
    main()
