"""The server's own options (the engine's are EngineConfig's): one frozen dataclass,
parsed once from the CLI. Flags are derived from the fields: `--zmq-port`, `--api-key`..."""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"  # HTTP and ZeroMQ bind address; 0.0.0.0 exposes the server
    port: int = 30000  # HTTP (native + OpenAI-compatible API)
    zmq_port: int = 30001  # ZeroMQ ROUTER socket for DSL clients
    api_key: str | None = None  # require "Authorization: Bearer <key>" on every HTTP route but /health
    max_request_bytes: int = 16 * 2**20  # larger HTTP bodies / ZeroMQ frames get 413
    served_model_name: str | None = None  # the name clients send as "model"; default: the model's file name
    health_timeout_s: float = 5.0  # /health: how long to wait for the scheduler's ping reply
    shutdown_timeout_s: float = 10.0  # on SIGTERM: time for in-flight requests before they are aborted
    startup_timeout_s: float = 600.0  # how long the launcher waits for the model to load
    throughput_log_s: float = 5.0  # period of the throughput log line while busy (0: off)
    parent_pid: int | None = None  # shut down when this process exits (for launchers like sl.Runtime)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["api_key"] = "<set>" if self.api_key else None
        return out


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server options")
    hints = typing.get_type_hints(ServerOptions)
    for f in fields(ServerOptions):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        kind = args[0] if args else hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        group.add_argument(flag, dest=f.name, type=kind, default=f.default, help=f"default: {f.default}")


def server_options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(**{f.name: getattr(args, f.name) for f in fields(ServerOptions)})


def add_serve_parser(subparsers, add_engine_args) -> None:
    """The `spruce serve` subcommand (the server modules load only when it runs)."""
    parser = subparsers.add_parser("serve", help="run the HTTP (native + OpenAI) and ZeroMQ server")
    add_server_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from spruce.runtime.server.launch import cmd_serve

    return cmd_serve(args)
