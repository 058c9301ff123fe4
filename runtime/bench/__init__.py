"""`spruce bench ...`: benchmarks that print ratios against a peer measured in the same run."""

from __future__ import annotations

# subcommand -> module with add_arguments(parser) and run(args, engine_options)
BENCHMARKS = {
    "offline": "spruce.runtime.bench.offline",
    "serving": "spruce.runtime.bench.serving",
    "prefix": "spruce.runtime.bench.prefix",
    "gpu": "spruce.runtime.bench.gpu",
    "json": "spruce.runtime.bench.json_bench",
    "grammar": "spruce.runtime.bench.grammar_bench",
    "spec": "spruce.runtime.bench.spec",
    "kernels": "spruce.runtime.bench.kernels",
    "fairness": "spruce.runtime.bench.fairness",
    "shapes": "spruce.runtime.bench.shapes",
}


def write_json(path: str | None, data: dict) -> None:
    if path:
        import json

        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)


def alternating_rounds(first, second, rounds: int) -> tuple[list, list]:
    """`first()` and `second()` run back to back in each of `rounds` rounds, who goes first
    alternating: each side's results by round. Their medians (or the rounds' ratios) make
    the figure, so a host's slow phase (this VM's ran both sides 25-45% slower for minutes)
    falls on both sides instead of deciding the ratio."""
    runs: tuple[list, list] = ([], [])
    for i in range(rounds):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            runs[side].append((first, second)[side]())
    return runs
