"""Tensor-parallel ranks: rank 0 (the EngineCore's process) starts the others of its
machine as child processes; each loads its slices of the model and runs the steps rank 0
sends (`ModelRunner.follow`) until told to stop.

    python -m spruce.runtime.engine.tp_worker --rank 1 --world 2 --init-addr 127.0.0.1:29500 \\
        --options '{"model_path": ..., "tp_size": 2}'

is what rank 0 runs for each follower; `spruce serve --node-rank 1 ...` (another machine)
and ranks other than 0 under torchrun run `run_follower` in the process itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import torch

from spruce.runtime.config import EngineConfig
from spruce.runtime.cores import default_threads
from spruce.runtime.executor.attention import resolve_backend
from spruce.runtime.executor.distributed import (
    Placement,
    TPGroup,
    backend_for,
    broadcast_ints,
    close_group,
    init_group,
    placement,
)
from spruce.runtime.executor.model_runner import ModelRunner
from spruce.runtime.models.loading.loader import DTYPES, load_model

logger = logging.getLogger("spruce")
FOLLOWER_EXIT_S = 10.0  # how long rank 0 waits for its followers to exit before killing them
KV_DTYPES = list(DTYPES.values())


def place(config: EngineConfig) -> Placement:
    p = config.parallel
    return placement(p.tp_size, p.nnodes, p.node_rank, p.dist_init_addr)


def join(config: EngineConfig, where: Placement) -> TPGroup:
    """Joins the ranks (after setting this rank's threads and GPU)."""
    p = config.parallel
    device = config.resolved_device
    per_node = max(where.world // p.nnodes, 1)
    if device == "cpu" and config.model.num_threads is None:
        torch.set_num_threads(max(default_threads() // per_node, 1))
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", where.rank % per_node)))
    backend = backend_for(p.dist_backend, device)
    return init_group(where.rank, where.world, where.init_addr, backend, p.dist_timeout_s)


def start_followers(config: EngineConfig, where: Placement) -> list[subprocess.Popen]:
    """The other ranks of this machine, as child processes that exit with this one."""
    options = json.dumps(config.to_options())
    procs = []
    for rank in where.local_followers:
        cmd = [
            sys.executable, "-m", "spruce.runtime.engine.tp_worker", "--rank", str(rank),
            "--world", str(where.world), "--init-addr", where.init_addr, "--options", options,
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd))
    return procs


def stop_followers(procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + FOLLOWER_EXIT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def share_pool_sizes(runner: ModelRunner | None, tp: TPGroup) -> list[int]:
    """Rank 0's KV pool and table sizes on every rank (followers pass None), so their
    pools take the same slot indices."""
    if runner is None:
        return broadcast_ints(None, 4, tp)
    table = runner.req_to_token.table
    kv_dtype = KV_DTYPES.index(runner.pool.shape.dtype)
    return broadcast_ints([runner.pool.num_slots, *table.shape, kv_dtype], 4, tp)


def run_follower(config: EngineConfig, where: Placement) -> None:
    """A rank other than 0: load this rank's slices, then run rank 0's steps."""
    procs = start_followers(config, where)  # the other ranks of a follower machine
    try:
        tp = join(config, where)
        device, m = config.resolved_device, config.model
        loaded = load_model(m.model_path, config.resolved_dtype, device, m.quantization, tp)
        num_slots, max_requests, context, kv_dtype = share_pool_sizes(None, tp)
        runner = ModelRunner(
            loaded, num_slots, max_requests, context, attention_backend=_backend(config, device),
            device=device, cuda_graph=False, kv_dtype=KV_DTYPES[kv_dtype], tp=tp,
        )  # fmt: skip
        runner.follow()
        logger.info("tensor parallel: rank %d stops", tp.rank)
    finally:
        close_group()
        stop_followers(procs)


def _backend(config: EngineConfig, device: str) -> str:
    return resolve_backend(config.model.attention_backend, device)


def _watch_parent(pid: int) -> None:
    def check() -> None:
        while os.getppid() == pid:
            time.sleep(0.5)
        os._exit(1)  # rank 0 is gone (even SIGKILLed): no orphans

    threading.Thread(target=check, name="spruce-tp-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a tensor-parallel follower rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init-addr", required=True)
    parser.add_argument("--options", required=True, help="the engine options (JSON)")
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    config = EngineConfig.from_options(**json.loads(args.options))
    level = (config.log_level or "warning").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s tp{args.rank}: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 stops us
    if args.parent_pid is not None:
        _watch_parent(args.parent_pid)
    try:
        run_follower(config, Placement(args.rank, args.world, args.init_addr, ()))
    except Exception as e:  # noqa: BLE001 - any failure of this rank: printed, exit status 2
        print(f"error: tensor-parallel rank {args.rank}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # OMP_WAIT_POLICY comes from rank 0's environment
    sys.exit(main())
