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
}


def write_json(path: str | None, data: dict) -> None:
    if path:
        import json

        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
