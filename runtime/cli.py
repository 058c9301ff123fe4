"""The `spruce` command: generate, serve, bench.

Engine options are flags derived from the config dataclasses (one place for each option):
`--kv-memory-gb 1`, `--disable-radix-cache`, `--schedule-policy fcfs`, ...
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from spruce.runtime.config import option_fields
from spruce.runtime.errors import SpruceError


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    for name, kind, default in option_fields():
        flag = "--model" if name == "model_path" else "--" + name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, dest=name, action="store_true", default=None)
        else:
            group.add_argument(flag, dest=name, type=kind, default=None, help=f"default: {default}")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line (unset flags are left out)."""
    names = {name for name, _, _ in option_fields()}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def cmd_generate(args: argparse.Namespace) -> int:
    from spruce.runtime.engine import Engine

    engine = Engine(**engine_options(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    start = time.perf_counter()
    n_tokens = 0
    for chunk in engine.generate(prompt, params, stream=True):
        sys.stdout.write(chunk["text"])
        sys.stdout.flush()
        n_tokens += len(chunk["output_ids"])
    seconds = time.perf_counter() - start
    print(f"\n[{n_tokens} tokens in {seconds:.2f} s, {n_tokens / seconds:.1f} tokens/s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spruce", description="Spruce structured-generation runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt on the local model")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    from spruce.runtime.server.options import add_serve_parser

    add_serve_parser(sub, add_engine_args)
    from spruce.runtime.bench import add_bench_parser

    add_bench_parser(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (getattr(args, "log_level", None) or "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except SpruceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
