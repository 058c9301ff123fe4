"""The `spruce` command: generate, serve, bench. This module owns the command line.

Engine and server options are flags derived from the config dataclasses (one place for each
option): `--kv-memory-gb 1`, `--disable-radix-cache`, `--schedule-policy fcfs`, `--api-key`...
The server and the benchmarks load only when their command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from spruce.runtime.config import ServerOptions, option_fields, use_omp_wait_policy
from spruce.runtime.errors import SpruceError
from spruce.runtime.limits import RequestLimits, ServingLimits

FLAG_ALIASES = {"tp_size": ["--tp"]}
API_KEY_ENV = "SPRUCE_API_KEY"  # the API key, when neither --api-key nor --api-key-file is given


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags default to None: an unset flag leaves the config's default."""
    group = parser.add_argument_group("engine options")
    for name, kind, default in option_fields():
        flags = ["--model" if name == "model_path" else "--" + name.replace("_", "-")]
        flags += FLAG_ALIASES.get(name, [])
        if kind is bool:
            group.add_argument(*flags, dest=name, action="store_true", default=None)
        else:
            group.add_argument(
                *flags, dest=name, type=kind, default=None, help=f"default: {default}"
            )


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line (unset flags are left out)."""
    names = {name for name, _, _ in option_fields()}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


SERVER_SECTIONS = {"request_limits": RequestLimits, "serving_limits": ServingLimits}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Server flags, the request and serving limits' (limits.py) among them."""
    sections = (
        ("server options", ServerOptions),
        ("request limits", RequestLimits),
        ("serving limits", ServingLimits),
    )
    for title, cls in sections:
        group = parser.add_argument_group(title)
        for name, kind, default in option_fields(cls):
            if name in SERVER_SECTIONS:
                continue
            flag = "--" + name.replace("_", "-")
            if kind is bool:
                group.add_argument(flag, dest=name, action="store_true", default=default)
            else:
                group.add_argument(
                    flag, dest=name, type=kind, default=default, help=f"default: {default}"
                )


def server_options(args: argparse.Namespace) -> ServerOptions:
    sections = {key: cls(**_values(args, cls)) for key, cls in SERVER_SECTIONS.items()}
    plain = {k: v for k, v in _values(args, ServerOptions).items() if k not in SERVER_SECTIONS}
    plain["api_key"] = api_key_of(plain.get("api_key"), plain.get("api_key_file"))
    return ServerOptions(**plain, **sections)


def api_key_of(given: str | None, path: str | None) -> str | None:
    """--api-key, else the contents of --api-key-file, else $SPRUCE_API_KEY. The file and the
    variable keep the key out of the command line, which every local user can read in /proc."""
    if given and path:
        raise SpruceError("give the API key once: --api-key or --api-key-file, not both")
    if path:
        return _read_key_file(path)
    return given or os.environ.get(API_KEY_ENV) or None


def _read_key_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SpruceError(
            f"cannot read the --api-key-file {path}: {getattr(e, 'strerror', None) or e}"
        ) from None
    if not key:
        raise SpruceError(f"the --api-key-file {path} is empty")
    return key


def _values(args: argparse.Namespace, cls: type) -> dict:
    return {name: getattr(args, name) for name, _, _ in option_fields(cls) if hasattr(args, name)}


def cmd_generate(args: argparse.Namespace) -> int:
    from spruce.runtime.engine.offline import Engine

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
    print(
        f"\n[{n_tokens} tokens in {seconds:.2f} s, {n_tokens / seconds:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from spruce.runtime.server.launch import serve

    return serve(server_options(args), engine_options(args))


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    from spruce.runtime.bench import BENCHMARKS

    return importlib.import_module(BENCHMARKS[args.bench]).run(args, engine_options(args))


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="run the HTTP (native + OpenAI) and ZeroMQ server")
    add_server_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=cmd_serve)


def add_bench_parser(subparsers) -> None:
    """`spruce bench NAME`: each benchmark module adds its own flags (`add_arguments`)."""
    import importlib

    from spruce.runtime.bench import BENCHMARKS

    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        parser = kinds.add_parser(name, help=module.__doc__.strip().splitlines()[0])
        module.add_arguments(parser)
        if getattr(module, "USES_ENGINE", True):
            add_engine_args(parser)
        parser.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spruce", description="Spruce structured-generation runtime"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt on the local model")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    use_omp_wait_policy()  # before anything imports torch
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
