"""Shared by the examples: which runtime to run on.

With `--address tcp://host:port` (or SPRUCE_ADDRESS set) an example uses that running
`spruce serve`; otherwise it starts one itself with sl.Runtime() (the bundled
SmolLM2-135M-Instruct), which stops when the example exits.
"""

from __future__ import annotations

import argparse
import os
import sys

import spruce.lang as sl


def use_runtime(description: str) -> argparse.Namespace:
    """Parses the example's flags and sets the default backend; returns the flags."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--address",
        default=os.environ.get("SPRUCE_ADDRESS"),
        help="ZeroMQ address of a running `spruce serve` (default: $SPRUCE_ADDRESS, else start one)",
    )
    args = parser.parse_args()
    if args.address:
        sl.set_default_backend(sl.RuntimeEndpoint(args.address))
    else:
        print("starting a local runtime (bundled SmolLM2-135M-Instruct)...", file=sys.stderr)
        sl.set_default_backend(sl.Runtime())
    return args
