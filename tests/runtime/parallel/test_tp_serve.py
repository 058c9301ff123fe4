"""`spruce serve --tp 2`: the scheduler process is rank 0 and starts rank 1; greedy text
equals the one-process Engine's; SIGTERM stops both ranks. The two-machine command lines
(--nnodes 2, --node-rank, --dist-init-addr) and torchrun's environment on one machine, too."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from spruce.runtime import Engine
from spruce.runtime.executor.distributed import free_port

PROMPT = "The quick brown fox jumps over"
SAMPLING = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def wait_healthy(proc: subprocess.Popen, url: str, log, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"not healthy in {timeout} s:\n{log.read_text()}")


def expected_text(model_dir) -> str:
    with Engine(
        str(model_dir), num_threads=1, kv_memory_gb=0.02, kv_cache_dtype="float32"
    ) as engine:
        return engine.generate(PROMPT, SAMPLING)["text"]


def spruce_serve(
    model_dir, log, *extra: str, env: dict | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "spruce.runtime", "serve", "--model", str(model_dir), "--port", str(port),
        "--zmq-port", str(free_port()), "--num-threads", "1", "--kv-memory-gb", "0.02",
        "--kv-cache-dtype", "float32", "--log-level", "info", *extra,
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    return proc, f"http://127.0.0.1:{port}"


def check_generate_then_stop(proc: subprocess.Popen, url: str, log, expected: str) -> str:
    """The server's greedy text, then SIGTERM; its log."""
    try:
        wait_healthy(proc, url, log)
        body = {"text": PROMPT, "sampling_params": SAMPLING}
        response = httpx.post(url + "/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["text"] == expected
    finally:
        proc.terminate()
        code = proc.wait(60)
    assert code == 0, log.read_text()
    return log.read_text()


def test_serve_tp_2(tiny_llama_dir, tmp_path):
    expected = expected_text(tiny_llama_dir)
    log = tmp_path / "server.log"
    proc, url = spruce_serve(tiny_llama_dir, log, "--tp", "2")
    text = check_generate_then_stop(proc, url, log, expected)
    assert "tensor parallel: rank 1 of 2 joined" in text and "tensor parallel: rank 1 stops" in text


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["nodes", "torchrun-env"])
def test_serve_tp_over_two_launches(tiny_llama_dir, tmp_path, launch):
    """Two `spruce serve` processes, as on two machines (--nnodes 2 --node-rank) or as
    torchrun starts them (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT): the one of rank 1
    runs only its rank (no front end); stopping rank 0's server stops both."""
    expected = expected_text(tiny_llama_dir)
    port = free_port()
    if launch == "nodes":
        common = ("--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}")
        args, envs = [(*common, "--node-rank", str(r)) for r in (0, 1)], [{}, {}]
    else:
        args = [("--tp", "2")] * 2
        env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        envs = [{**env, "RANK": str(r)} for r in (0, 1)]
    follower_log = tmp_path / "rank1.log"
    follower, _ = spruce_serve(tiny_llama_dir, follower_log, *args[1], env=envs[1])
    log = tmp_path / "rank0.log"
    proc, url = spruce_serve(tiny_llama_dir, log, *args[0], env=envs[0])
    check_generate_then_stop(proc, url, log, expected)
    assert follower.wait(30) == 0, follower_log.read_text()
    text = follower_log.read_text()
    assert "rank 1 of 2: following rank 0" in text and "tensor parallel: rank 1 stops" in text
