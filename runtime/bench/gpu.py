"""GPU check: the GPU tests, then offline throughput for each attention backend.

Runs `pytest -m gpu` (from a source checkout), then the same seeded requests through the
Engine with the torch, triton (with and without CUDA graphs) and, when installed,
flashinfer backends, in one process sharing one copy of the weights, and prints a table:
output tokens/s, the decode step at the largest batch, batch-1 decode tokens/s, and the
constrained mask kernel (triton) against the torch reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

import torch

from spruce.runtime.bench import write_json
from spruce.runtime.bench.offline import mean_decode_step, synthetic_prompts

USES_ENGINE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len-min", type=int, default=64)
    parser.add_argument("--input-len-max", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--tests-dir", default="tests")
    parser.add_argument("--output-json", default=None)


def run_gpu_tests(tests_dir: str) -> dict:
    if not os.path.isdir(tests_dir):
        return {"skipped": f"no {tests_dir} folder (run from a source checkout)"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", tests_dir, "-p", "no:cacheprovider"],
        capture_output=True, text=True,
    )  # fmt: skip
    tail = proc.stdout.strip().splitlines()[-1:] or [proc.stderr.strip()[-300:]]
    print("\n".join(proc.stdout.strip().splitlines()[-15:]))
    return {
        "returncode": proc.returncode,
        "summary": tail[0],
        "seconds": time.perf_counter() - start,
    }


def backend_configs() -> list[tuple[str, str, bool]]:
    configs = [
        ("torch", "torch", True),
        ("triton", "triton", True),
        ("triton+graphs", "triton", False),
    ]
    if importlib.util.find_spec("flashinfer") is not None:
        configs.append(("flashinfer", "flashinfer", True))
    return configs


def measure_backend(engine, prompts, output_len: int) -> dict:
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    engine.generate(
        input_ids=prompts[:4], sampling_params={**params, "max_new_tokens": 8}
    )  # warm-up
    engine.flush_cache()
    engine.core.step_log = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    step_s, batch = mean_decode_step(engine.core.step_log)
    engine.core.step_log = None
    engine.flush_cache()
    start = time.perf_counter()
    one = engine.generate(
        input_ids=prompts[0][:32], sampling_params={**params, "max_new_tokens": 128}
    )
    batch1 = len(one["output_ids"]) / (time.perf_counter() - start)
    return {
        "output_tokens_per_s": sum(len(o["output_ids"]) for o in outs) / seconds,
        "decode_step_ms": step_s * 1e3,
        "decode_batch": batch,
        "batch1_tokens_per_s": batch1,
        "outputs": [o["output_ids"] for o in outs],
    }


def mask_kernel_check() -> dict:
    from spruce.constrained import apply_bitmask
    from spruce.runtime.executor.kernels.triton_bitmask import apply_token_bitmask_inplace_triton

    logits = torch.randn(64, 151936, device="cuda")
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (64, (151936 + 31) // 32), dtype=torch.int32, device="cuda"
    )
    reference = logits.clone()
    apply_bitmask(reference, bitmask)
    fast = logits.clone()
    apply_token_bitmask_inplace_triton(fast, bitmask)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(100):
        apply_token_bitmask_inplace_triton(fast, bitmask)
    torch.cuda.synchronize()
    return {
        "equal": bool(torch.equal(reference, fast)),
        "microseconds": (time.perf_counter() - start) * 1e4,
    }


def run(args: argparse.Namespace, engine_options: dict) -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU here: the GPU figures cannot be measured on this machine")
        return 1
    from spruce.runtime.engine.offline import Engine

    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    if not args.skip_tests:
        result["tests"] = run_gpu_tests(args.tests_dir)
    options = {
        k: v
        for k, v in engine_options.items()
        if k not in ("attention_backend", "disable_cuda_graph")
    }
    base = None
    rows = {}
    for label, backend, no_graph in backend_configs():
        engine = Engine(
            loaded=base.core.loaded if base else None,
            **options,
            attention_backend=backend,
            disable_cuda_graph=no_graph,
        )
        base = base or engine
        prompts = synthetic_prompts(
            engine.tokenizer, args.num_prompts, args.input_len_min, args.input_len_max
        )
        rows[label] = measure_backend(engine, prompts, args.output_len)
        print(
            f"{label:14s} {rows[label]['output_tokens_per_s']:10.0f} out tok/s  decode step {rows[label]['decode_step_ms']:7.2f} ms"
            f" at batch {rows[label]['decode_batch']}  batch-1 {rows[label]['batch1_tokens_per_s']:7.1f} tok/s"
        )
        if engine is not base:
            del engine
    reference = rows["torch"]["outputs"]
    for row in rows.values():
        row["same_greedy_tokens_as_torch"] = sum(
            a == b for a, b in zip(row.pop("outputs"), reference)
        )
    result["backends"] = rows
    result["mask_kernel"] = mask_kernel_check()
    print(
        f"mask kernel (triton) equal to torch: {result['mask_kernel']['equal']}, {result['mask_kernel']['microseconds']:.1f} us for 64 x 151936"
    )
    write_json(args.output_json, result)
    return 0
