"""Soak with hostile traffic (issue 28): well-behaved clients run the same workload twice,
once on a quiet server and once with hostile requests mixed in (backtracking stop regexes
and schema patterns, giant character classes, logprob requests past the response budget,
garbage and oversize ZeroMQ frames from a peer without the key). Every good request
completes with the tokens it gives alone, every hostile one gets a 4xx or a bounded answer,
the server stays healthy, and the memory of the front end and of its children after a
second hostile round is within 10% of what it was after the first (what is bounded is full
by then; what leaks keeps growing). Prints the good clients' p99 latency quiet and under
hostile traffic (a figure, not an assertion: timings depend on the machine)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import threading
import time

import httpx
import pytest
import zmq
from test_server import API_KEY, AUTH, child_pids, start_server, stop_server
from test_soak import idle_slots, rss_kb

pytestmark = pytest.mark.slow

GOOD_CLIENTS, GOOD_REQUESTS = 6, 600
HOSTILE_CLIENTS = 4
# Each hostile client pauses between requests: the soak is about what one request can cost
# the others; a flood of any request, however cheap, is a matter of rate limits.
HOSTILE_PAUSE_S = 0.05
TOKENS = 8
MAX_REQUEST_BYTES = 1024 * 1024
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("soak-hostile") / "server.log"
    srv = start_server(
        tiny_llama_dir,
        log_path,
        "--api-key",
        API_KEY,
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
    )
    yield srv
    assert stop_server(srv) == 0, srv.log()


def good_body(i: int) -> dict:
    params = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    return {"text": f"good request {i % 12}", "sampling_params": params}


async def good_traffic(http: httpx.AsyncClient) -> tuple[list[float], dict[int, list[int]]]:
    """GOOD_REQUESTS greedy requests from GOOD_CLIENTS clients: latencies and output ids."""
    jobs = list(range(GOOD_REQUESTS))
    latencies: list[float] = []
    outputs: dict[int, list[int]] = {}

    async def client() -> None:
        while jobs:
            i = jobs.pop()
            started = time.monotonic()
            r = await http.post("/generate", json=good_body(i))
            latencies.append(time.monotonic() - started)
            assert r.status_code == 200, r.text
            outputs[i] = r.json()["output_ids"]

    await asyncio.gather(*(client() for _ in range(GOOD_CLIENTS)))
    return latencies, outputs


def giant_class_regex(rng: random.Random) -> str:
    """One character class of ~150k distinct code points, in a random order (a new cache key
    every time), within --max-constraint-chars."""
    points = [chr(c) for c in range(0x4E00, 0x4E00 + 150_000) if not 0xD800 <= c <= 0xDFFF]
    rng.shuffle(points)
    return "[" + "".join(points).replace("\\", "").replace("]", "").replace("^", "") + "]{1,3}"


HOSTILE_KINDS = ("redos_stop", "redos_pattern", "giant_class", "logprobs")
GIANT_PER_ROUND = 16  # distinct giant classes a round sends (each a new cache key)


def hostile_body(kind: str, rng: random.Random) -> dict:
    if kind == "redos_stop":
        params = {"max_new_tokens": 64, "temperature": 0, "regex": "a{64}", "stop_regex": "(a+)+b"}
        return {"text": "x", "sampling_params": params}
    if kind == "redos_pattern":
        schema = {
            "type": "object",
            "patternProperties": {"^(a+)+b$": {"type": "integer"}},
            "maxProperties": 2,
        }
        return {"text": "x", "sampling_params": {"max_new_tokens": 16, "json_schema": schema}}
    if kind == "giant_class":
        return {
            "text": "x",
            "sampling_params": {"max_new_tokens": 3, "regex": giant_class_regex(rng)},
        }
    # (1000 + 16) positions x (1 + 20) entries x n 128: 2.7M entries from a few KB of body
    params = {"max_new_tokens": 16, "n": 128, "ignore_eos": True}
    return {
        "input_ids": [5] * 1000,
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 20,
    }


class Hostile:
    """Hostile HTTP requests and ZeroMQ garbage until `stopping` is set, in a process of its
    own (`run_hostile`): made in the good clients' process, the hostile bodies (150k-element
    shuffles, megabytes to encode and send) would slow the clients being measured."""

    def __init__(self, url: str, zmq_url: str, stopping) -> None:
        self.url, self.zmq_url, self.stopping = url, zmq_url, stopping
        self.statuses: dict[str, list[int]] = {k: [] for k in HOSTILE_KINDS}
        self.errors: list[str] = []
        self.frames = 0
        self.bodies: dict[str, list[bytes]] = {}

    def prepare(self, seed: int) -> None:
        """The round's request bodies, encoded ahead."""
        rng = random.Random(seed)
        self.bodies = {
            kind: [
                json.dumps(hostile_body(kind, rng), ensure_ascii=False).encode()
                for _ in range(GIANT_PER_ROUND if kind == "giant_class" else 1)
            ]
            for kind in HOSTILE_KINDS
        }

    async def http_loops(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, headers=AUTH, timeout=300) as http:
            await asyncio.gather(*(self.http_loop(http, seed) for seed in range(HOSTILE_CLIENTS)))

    async def http_loop(self, http: httpx.AsyncClient, seed: int) -> None:
        for n in range(10**6):
            if self.stopping.is_set():
                return
            kind = HOSTILE_KINDS[(seed + n) % len(HOSTILE_KINDS)]
            bodies = self.bodies[kind]
            try:
                r = await http.post("/generate", content=bodies[n % len(bodies)], headers=JSON)
                self.statuses[kind].append(r.status_code)
                if r.status_code == 200 and kind == "redos_stop":
                    assert r.json()["text"] == "a" * 64, r.json()["text"]
                if kind == "logprobs":
                    assert "--max-logprob-entries" in r.json()["error"]["message"], r.text
            except Exception as e:  # noqa: BLE001 - reported at the end
                self.errors.append(f"{kind}: {e!r}")
            await asyncio.sleep(HOSTILE_PAUSE_S)

    def zmq_loop(self) -> None:
        """A peer without the key: random bytes, oversize frames, well-formed requests with a
        wrong key; nothing it sends may cost the server more than a dropped frame."""
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.connect(self.zmq_url)
        rng = random.Random(7)
        big = (
            b'{"type": "generate", "rid": "big", "text": "' + b"x" * (2 * MAX_REQUEST_BYTES) + b'"}'
        )
        wrong_key = b'{"type": "generate", "rid": "k", "text": "hi", "api_key": "wrong"}'
        try:
            while not self.stopping.is_set():
                for frame in (os.urandom(rng.randrange(1, 4096)), big, wrong_key):
                    try:
                        sock.send(frame, zmq.NOBLOCK)
                        self.frames += 1
                    except zmq.Again:
                        pass
                while sock.poll(0):
                    sock.recv()
                time.sleep(0.01)
        finally:
            sock.close()
            context.term()


def run_hostile(url: str, zmq_url: str, seed: int, ready, stopping, results) -> None:
    """The hostile process: prepares, says ready, attacks until stopped, reports."""
    hostile = Hostile(url, zmq_url, stopping)
    hostile.prepare(seed)
    ready.set()
    zmq_thread = threading.Thread(target=hostile.zmq_loop, daemon=True)
    zmq_thread.start()
    asyncio.run(hostile.http_loops())
    zmq_thread.join(60)
    results.put((hostile.statuses, hostile.errors, hostile.frames))


def process_rss_mb(pids: list[int]) -> list[float]:
    return [rss_kb(pid) / 1024 for pid in pids]


def percentiles(values: list[float]) -> list[float]:
    ordered = sorted(values)
    return [
        round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) for q in (0.5, 0.9, 0.99)
    ]


def test_hostile_soak(server):
    """Quiet run, then two hostile rounds: the first fills what is bounded (caches, worker
    pools, allocator arenas), the second must leave memory where the first did."""
    pids = [server.proc.pid, *child_pids(server.proc.pid)]
    idle = idle_slots(server.url)
    statuses: dict[str, list[int]] = {k: [] for k in HOSTILE_KINDS}
    errors: list[str] = []
    frames = 0

    async def run():
        limits = httpx.Limits(max_connections=GOOD_CLIENTS + 2)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=300, limits=limits
        ) as http:
            return await good_traffic(http)

    def hostile_round(seed: int):
        """The good traffic with the hostile process running beside it."""
        nonlocal frames
        fork = multiprocessing.get_context("fork")
        ready, stopping, results = fork.Event(), fork.Event(), fork.Queue()
        child = fork.Process(
            target=run_hostile, args=(server.url, server.zmq_url, seed, ready, stopping, results)
        )
        child.start()
        try:
            assert ready.wait(120), "the hostile process did not start"
            return asyncio.run(run())
        finally:
            stopping.set()
            round_statuses, round_errors, round_frames = results.get(timeout=300)
            child.join(60)
            for kind, got in round_statuses.items():
                statuses[kind] += got
            errors.extend(round_errors)
            frames += round_frames

    asyncio.run(run())  # warm-up: first compiles, allocator pools
    quiet_latencies, quiet_outputs = asyncio.run(run())
    hostile_round(1)
    memory_before = process_rss_mb(pids)
    hostile_latencies, hostile_outputs = hostile_round(2)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    memory_after = process_rss_mb(pids)
    leaked = idle_slots(server.url) - idle
    info = httpx.get(server.url + "/server_info", headers=AUTH, timeout=30).json()
    quiet, loud = percentiles(quiet_latencies), percentiles(hostile_latencies)
    print(
        f"\nhostile soak: good requests' latency p50 / p90 / p99 {quiet} s quiet, {loud} s with hostile traffic "
        f"(p99 {loud[-1] / quiet[-1]:.2f}x); hostile answers { {k: sorted(set(v)) for k, v in statuses.items()} } "
        f"({sum(map(len, statuses.values()))} requests), {frames} ZeroMQ frames; "
        f"RSS MB (front end, children) after the first hostile round {[round(m) for m in memory_before]}, "
        f"after the second {[round(m) for m in memory_after]}"
    )
    assert errors == [], errors[:5]
    assert hostile_outputs == quiet_outputs  # greedy: the same tokens as on the quiet server
    for kind, answers in statuses.items():
        assert answers and all(s in (200, 400) for s in answers), (kind, answers)
    assert set(statuses["logprobs"]) == {400}  # past the response budget
    assert frames > 0
    assert leaked == 0 and info["in_flight_requests"] == 0
    for before, after in zip(memory_before, memory_after):
        assert after <= before * 1.10, (memory_before, memory_after)
