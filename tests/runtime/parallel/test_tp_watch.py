"""Tensor-parallel ranks are watched (issue 28): the rendezvous store listens on the address
given, not on every interface; a follower killed with SIGKILL under `spruce serve --tp 2`
ends the request in flight with an error naming no file or address, and the server goes
unhealthy and exits (1) instead of answering with gloo's internals or hanging."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist
from test_tp_engine import GREEDY, OPTIONS, ids
from test_tp_serve import spruce_serve, wait_healthy

from spruce.runtime import Engine
from spruce.runtime.executor.distributed import free_port, rendezvous_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from test_server import child_pids

TIMEOUT = datetime.timedelta(seconds=20)
ADDRESS_OR_PATH = re.compile(r"/\w|\d+\.\d+\.\d+\.\d+|:\d{2,5}\b|gloo|\.cpp|\.py")


def binds_elsewhere(port: int) -> bool:
    """Whether another loopback address can take the port: not while something listens on
    every interface there."""
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.2", port))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def test_the_rendezvous_store_listens_on_the_address_given_only():
    port = free_port()
    store = rendezvous_store(
        f"127.0.0.1:{port}", 0, 1, TIMEOUT
    )  # world 1: it waits for no other rank
    peer = rendezvous_store(f"127.0.0.1:{port}", 1, 1, TIMEOUT)
    store.set("k", "v")
    assert peer.get("k") == b"v"
    assert binds_elsewhere(port)
    # what torch does by itself (the issue): every interface, so the same probe fails
    wildcard = dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT)
    assert not binds_elsewhere(wildcard.port)


@pytest.mark.slow  # idles past the collectives' deadline on purpose
def test_an_idle_group_outlives_the_collective_deadline(tiny_llama_dir):
    """Collectives time out after --dist-timeout-s (not a year); rank 0's keepalives keep an
    idle follower from timing out while it waits for the next step."""
    prompts = [ids(50 + i, 6 + i) for i in range(2)]
    with Engine(str(tiny_llama_dir), tp_size=2, dist_timeout_s=10, **OPTIONS) as tp:
        assert tp.core.tp.timeout_s == 10
        first = [o["output_ids"] for o in tp.generate(input_ids=prompts, sampling_params=GREEDY)]
        time.sleep(25)  # idle for more than twice the deadline
        assert all(p.poll() is None for p in tp.core.followers)
        assert [
            o["output_ids"] for o in tp.generate(input_ids=prompts, sampling_params=GREEDY)
        ] == first


def follower_pid(server_pid: int) -> int:
    """The rank-1 process: a child of the scheduler process (a child of the server)."""
    for child in child_pids(server_pid):
        for grandchild in child_pids(child):
            if "spruce.runtime.engine.tp_worker" in Path(f"/proc/{grandchild}/cmdline").read_text(
                errors="replace"
            ):
                return grandchild
    raise AssertionError("no tensor-parallel follower found")


@pytest.mark.slow  # its own two-rank server
def test_a_killed_follower_fails_the_request_cleanly_and_the_server_goes_unhealthy(
    tiny_llama_dir, tmp_path
):
    log = tmp_path / "server.log"
    proc, url = spruce_serve(tiny_llama_dir, log, "--tp", "2")
    try:
        wait_healthy(proc, url, log)
        rank1 = follower_pid(proc.pid)
        body = {
            "text": "Once",
            "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True},
        }
        first, events = threading.Event(), []

        def stream() -> None:
            with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[len("data: ") :]))
                        first.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert first.wait(60)
        os.kill(rank1, signal.SIGKILL)
        thread.join(120)
        assert not thread.is_alive()
        error = events[-1].get("error")
        assert error is not None, events[-1]
        assert "tensor-parallel" in error["message"] and "cannot compute" in error["message"]
        assert not ADDRESS_OR_PATH.search(error["message"]), error["message"]
        assert proc.wait(120) == 1, log.read_text()  # unhealthy: it exits for a restart
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
