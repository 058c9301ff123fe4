"""Process lifecycle of `spruce serve`: SIGTERM drains and leaves no child alive; a killed
scheduler makes the server exit (never hang). Each test starts its own server."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server import child_pids, free_port, pid_alive, start_server, stop_server


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def test_sigterm_drains_and_leaves_no_child(tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir, tmp_path / "server.log", "--shutdown-timeout-s", "2")
    children = child_pids(server.proc.pid)
    assert children, "the scheduler runs in a child process"
    outcome = {}

    def long_request():  # still running when SIGTERM comes: aborted after the grace period
        body = {
            "text": "long",
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
            "stream": True,
        }
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=30) as r:
            outcome["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(20) == 0, server.log()  # the grace period, then exit 0
    thread.join(10)
    assert wait_gone(children, 5) == [], "a child process outlived the server"
    assert outcome["events"][-1] == "data: [DONE]"  # the stream was closed properly
    assert "received SIGTERM" in server.log()


def test_killed_scheduler_makes_the_server_exit(tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir, tmp_path / "server.log")
    children = child_pids(server.proc.pid)
    [scheduler] = [p for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    try:
        os.kill(scheduler, signal.SIGKILL)
        code = server.proc.wait(20)
    finally:
        stop_server(server)
    assert code != 0
    assert "scheduler process exited unexpectedly" in server.log()
    assert wait_gone(children, 5) == []


@pytest.mark.parametrize("signal_name", ["SIGKILL"])
def test_scheduler_exits_when_the_front_end_is_killed(tiny_llama_dir, tmp_path, signal_name):
    server = start_server(tiny_llama_dir, tmp_path / "server.log")
    children = child_pids(server.proc.pid)
    ipc_dir = re.search(r"sockets in ([^)\s]+)", server.log()).group(1)
    assert os.path.isdir(ipc_dir)
    server.proc.send_signal(getattr(signal, signal_name))
    server.proc.wait(10)
    assert wait_gone(children, 10) == [], "an orphaned child kept running"
    deadline = time.monotonic() + 5
    while os.path.exists(ipc_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(ipc_dir), "the socket folder was left behind"


def test_health_is_503_while_loading_then_200(tiny_llama_dir, tmp_path):
    port, zmq_port = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "spruce.runtime", "serve", "--model", str(tiny_llama_dir), "--port", str(port),
        "--zmq-port", str(zmq_port), "--num-threads", "1", "--kv-memory-gb", "0.02",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            seen.append((r.status_code, r.json().get("error", {}).get("message", "")))
            if r.status_code == 200:
                break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0].decode()
    assert seen and seen[-1][0] == 200, output
    assert all(code == 503 and "loading" in message for code, message in seen[:-1])
    assert len(seen) > 1, "the server should answer 503 while the model loads"
    assert "Spruce server ready" in output and f"http://127.0.0.1:{port}" in output


@pytest.mark.parametrize("problem", ["missing model", "port in use"])
def test_startup_errors_are_clear(tmp_path, problem, tiny_llama_dir):
    port = free_port()
    model = str(tmp_path / "no-such-model") if problem == "missing model" else str(tiny_llama_dir)
    with socket.socket() as busy:
        if problem == "port in use":
            busy.bind(("127.0.0.1", port))
            busy.listen()
        cmd = [
            sys.executable, "-m", "spruce.runtime", "serve", "--model", model, "--port", str(port),
            "--zmq-port", str(free_port()),
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    expected = "does not exist" if problem == "missing model" else "pick another port with --port"
    assert expected in result.stderr, result.stderr
