"""The machine's memory bandwidth and the weight bytes a decode step reads: batch-1 decode
as a share of the bandwidth (`spruce bench offline --compare llama.cpp`)."""

from __future__ import annotations

import time

import torch

BUFFER_GIB = 1.0  # far beyond any cache


def memory_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes/s of the fastest of `repeats` sums over a BUFFER_GIB float32 tensor on
    `threads` threads: a streaming read, as a memory-bound decode step makes."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(int(BUFFER_GIB * 2**30) // 4)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        return buffer.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def decode_bytes_per_token(path: str) -> int:
    """Weight bytes one batch-1 decode step reads from a GGUF file: every tensor, less the
    embedding table when the output head is a tensor of its own (a step then reads one row
    of the table)."""
    from spruce.runtime.models.loading.gguf import read_gguf

    tensors = read_gguf(path).tensors
    total = sum(info.nbytes for info in tensors.values())
    return total - tensors["token_embd.weight"].nbytes if "output.weight" in tensors else total


def print_bandwidth(path: str, threads: int, ours: float, theirs: float) -> dict:
    """The memory bandwidth measured now and batch-1 decode (tokens/s) as a share of it."""
    bandwidth, per_token = memory_bandwidth(threads), decode_bytes_per_token(path)
    shares = {"Spruce": per_token * ours / bandwidth, "llama.cpp": per_token * theirs / bandwidth}
    print(
        f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (sum over 1 GiB, {threads} threads, best "
        f"of 5); a decode step reads {per_token / 1e9:.2f} GB of weights; batch-1 decode uses "
        + ", ".join(f"{name} {share:.0%}" for name, share in shares.items())
        + " of the bandwidth"
    )
    return {"bytes_per_s": bandwidth, "weight_bytes_per_token": per_token, "share": shares}
