"""Quantized linear kernels on the model's own layers: one pass of every linear layer (and
the output head) per row count, through each kernel that runs here.

`cpu_quant_ops.kernel` picks one of three by row count: the integer GEMV, the integer GEMM
(AVX-512 VNNI, 32-value formats) and the float GEMM. This runs each of them on the loaded
model's quantized weights (their own shapes and formats) for every row count in --rows,
the kernels alternated, the least of --repeats passes each, and prints the time per pass and
each kernel's ratio to the float GEMM, with the one `linear` takes marked.
"""

from __future__ import annotations

import argparse
import time

import torch

USES_ENGINE = True
KERNELS = ("integer", "igemm", "gemm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rows", default="1,4,8,12,16,32,64,512", help="row counts, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=5, help="passes per kernel and row count")


def quantized_linears(model) -> list:
    """The model's quantized linear layers and output head (cpu_quant_ops' weights)."""
    from spruce.runtime.models.layers import QuantizedLinear

    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def kernel_calls(qtype: str, isa: str) -> dict:
    """kernel name -> linear(x, qtype, blocks, bias) for the kernels that run `qtype` here."""
    from spruce.runtime.executor.kernels import cpu_quant_ops as ops

    calls = {
        "integer": lambda x, q, b, bias: ops.integer_linear(x, q, b, bias, isa),
        "gemm": ops.gemm_linear,
    }
    if ops.igemm_runs(qtype, isa):
        calls["igemm"] = ops.integer_gemm_linear
    return calls


def time_passes(layers: list, rows: int, repeats: int) -> dict[str, float]:
    """Seconds per pass over `layers` for each kernel (the least of `repeats`, alternated);
    a kernel missing for some layer's format is left out."""
    from spruce.runtime.executor.kernels import cpu_quant_ops as ops

    isa = ops.best_isa()
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
    per_layer = [kernel_calls(m.qtype, isa) for m in layers]
    names = [k for k in KERNELS if all(k in calls for calls in per_layer)]
    best = {name: float("inf") for name in names}
    for _ in range(repeats + 1):  # the first round warms up
        for name in names:
            start = time.perf_counter()
            for m, calls in zip(layers, per_layer):
                calls[name](inputs[m.in_features], m.qtype, m.blocks, m.bias)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def run(args: argparse.Namespace, engine_options: dict) -> int:
    from spruce.runtime.config import EngineConfig
    from spruce.runtime.executor.kernels import cpu_quant_ops as ops
    from spruce.runtime.models.loading.loader import load_model

    config = EngineConfig.from_options(**engine_options)
    model = config.model
    loaded = load_model(
        model.model_path, config.resolved_dtype, config.resolved_device, model.quantization
    )
    torch.set_num_threads(config.num_threads)
    layers = quantized_linears(loaded.model)
    if not layers or not ops.available():
        print("no quantized linear layers on the CPU kernels: nothing to time")
        return 1
    formats = sorted({m.qtype for m in layers})
    print(
        f"{len(layers)} layers ({', '.join(formats)}), {config.num_threads} threads, {ops.best_isa()}"
    )
    print("| rows | " + " | ".join(f"{k} ms" for k in KERNELS) + " | / gemm |")
    print("| --- " * (len(KERNELS) + 2) + "|")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            times = time_passes(layers, rows, args.repeats)
            chosen = {ops.kernel(q, rows) for q in formats}
            cells = [
                ("**%.2f**" if k in chosen else "%.2f") % (times[k] * 1e3) if k in times else "-"
                for k in KERNELS
            ]
            ratios = ", ".join(f"{k} {times[k] / times['gemm']:.2f}" for k in times if k != "gemm")
            print(f"| {rows} | " + " | ".join(cells) + f" | {ratios} |")
    return 0
