"""Batch-1 quantized GEMV against the machine's memory bandwidth.

For each format and real model shape (Llama-3.1-8B, Llama-3.2-1B; gate/up fused), times
`cpu_quant_ops.linear` on one activation row and prints the weight bytes it streamed per
second, next to a streaming read (torch.sum over a 1 GiB float32 tensor, best of 5) at the
same thread count, measured in the same run. Several distinct random weight matrices are
read in rotation, at least --min-mib in all, so the weights come from memory, not from the
caches. Numbers on a machine shared with other work vary: run it a few times.

    python scripts/bench_gemv.py [--quants q4_0,q4_k] [--threads 1,2] [--models 8b,1b]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from spruce.runtime.executor.kernels import cpu_quant_ops as ops
from spruce.runtime.models.loading.gguf_quant import GGML_TYPES

SHAPES = {  # [n, k] of the linear layers: attention out / down, down, fused gate+up
    "8b": [(14336, 4096), (4096, 14336), (28672, 4096)],
    "1b": [(8192, 2048), (2048, 8192), (16384, 2048)],
}


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """n rows of random blocks of `qtype` with finite fp16 scales (and mins)."""
    kind = GGML_TYPES[ops.QUANT_TYPES[qtype].ggml_id].block
    count = n * k // ops.QUANT_TYPES[qtype].block_size
    blocks = np.frombuffer(rng.bytes(count * kind.itemsize), kind).copy()
    blocks["d"] = (rng.standard_normal(count) * 0.02).astype(np.float16)
    for offset in {"m", "dmin"} & set(kind.names):
        blocks[offset] = (rng.standard_normal(count) * 0.1).astype(np.float16)
    return torch.from_numpy(blocks.view(np.uint8).reshape(n, -1))


def bandwidth(reps: int = 5) -> float:
    """GB/s of a streaming read: torch.sum over 1 GiB of float32, best of `reps`."""
    data = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def gemv_rate(qtype: str, n: int, k: int, min_mib: int, seconds: float) -> float:
    """GB/s of weight bytes read by batch-1 `linear` calls, best pass over the rotation."""
    rng = np.random.default_rng(n + k)
    one = ops.row_bytes(qtype, k) * n
    copies = max(1, -(-min_mib * (1 << 20) // one))
    weights = [random_blocks(qtype, n, k, rng) for _ in range(copies)]
    x = torch.randn(1, k)
    for w in weights:
        ops.linear(x, qtype, w)  # warm: library, pages
    best, spent = float("inf"), 0.0
    while spent < seconds:
        start = time.perf_counter()
        for w in weights:
            ops.linear(x, qtype, w)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return one * copies / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quants", default="q4_0,q4_k,q6_k,q8_0")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--models", default="8b,1b")
    parser.add_argument("--min-mib", type=int, default=160, help="weights read in rotation")
    parser.add_argument("--seconds", type=float, default=1.0, help="per format and shape")
    args = parser.parse_args()
    assert ops.available(), "the C kernels did not build"
    print(f"isa {ops.best_isa()}; GB/s of weights streamed at batch 1 (fraction of the read)")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        read = bandwidth()
        rows = []
        for model in args.models.split(","):
            for qtype in args.quants.split(","):
                rates = [
                    gemv_rate(qtype, n, k, args.min_mib, args.seconds) for n, k in SHAPES[model]
                ]
                rows.append((model, qtype, rates))
        read = max(read, bandwidth())  # before and after: a busy neighbour lowers one of them
        print(f"\nthreads {threads}: streaming read {read:.1f} GB/s (best before and after)")
        for model, qtype, rates in rows:
            cells = [
                f"[{n}x{k}] {rate:5.1f} ({rate / read:4.0%})"
                for (n, k), rate in zip(SHAPES[model], rates)
            ]
            print(f"  {model} {qtype:5} " + "  ".join(cells))


if __name__ == "__main__":
    main()
