"""`spruce bench ...`: benchmarks that print ratios against a peer measured in the same run."""

from __future__ import annotations

import importlib

# subcommand -> module with add_arguments(parser) and run(args)
BENCHMARKS = {
    "offline": "spruce.runtime.bench.offline",
    "serving": "spruce.runtime.bench.serving",
    "prefix": "spruce.runtime.bench.prefix",
    "gpu": "spruce.runtime.bench.gpu",
    "json": "spruce.runtime.bench.json_bench",
}


def add_bench_parser(subparsers, add_engine_args) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        parser = kinds.add_parser(name, help=module.__doc__.strip().splitlines()[0])
        module.add_arguments(parser)
        if getattr(module, "USES_ENGINE", True):
            add_engine_args(parser)
        parser.set_defaults(func=module.run)


def write_json(path: str | None, data: dict) -> None:
    if path:
        import json

        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
