"""`spruce serve --dp 2`: cache-aware routing keeps a few-shot workload's prefix-cache hit
rate at a single replica's (round-robin loses some), health / flush / metrics over two
replicas, and a killed replica fails only its own requests while the other keeps serving.

Real servers on the tiny model (two scheduler processes each), few tokens per request.
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import start_server, stop_server

PREFIXES = 4
QUESTIONS = 16
SHOT = "Question: what is {a} plus {b}? Answer: {c}.\n"


def few_shot_prompts() -> list[list[str]]:
    """PREFIXES few-shot prefixes (long) x QUESTIONS short questions, by prefix."""
    out = []
    for p in range(PREFIXES):
        prefix = f"Task {p}: add numbers.\n" + "".join(
            SHOT.format(a=p + i, b=i * 3, c=p + 4 * i) for i in range(8)
        )
        out.append([prefix + f"Question: what is {p} plus {q}? Answer:" for q in range(QUESTIONS)])
    return out


def generate(url: str, text: str, max_new_tokens: int = 2, **sampling) -> httpx.Response:
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling},
    }
    return httpx.post(url + "/generate", json=body, timeout=120)


def run_few_shot(url: str) -> float:
    """The workload: each prefix's first question, then the rest in a seeded random order (a
    fixed cycle over the prefixes would line up with round-robin), 8 at a time; returns the
    share of prompt tokens served from the prefix caches."""
    prompts = few_shot_prompts()
    first = [questions[0] for questions in prompts]
    rest = [questions[q] for q in range(1, QUESTIONS) for questions in prompts]
    random.Random(0).shuffle(rest)
    metas = []
    with ThreadPoolExecutor(8) as pool:
        for batch in (first, rest):
            responses = list(pool.map(lambda t: generate(url, t), batch))
            assert all(r.status_code == 200 for r in responses), [
                r.text for r in responses if r.status_code != 200
            ]
            metas += [r.json()["meta_info"] for r in responses]
    return sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)


def server_info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=30).json()


@pytest.fixture(scope="module")
def dp_server(tiny_llama_dir, tmp_path_factory):
    server = start_server(tiny_llama_dir, tmp_path_factory.mktemp("dp") / "server.log", "--dp", "2")
    yield server
    assert stop_server(server) == 0, server.log()


def test_cache_aware_routing_keeps_the_hit_rate(dp_server, tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dp_compare")
    single = start_server(tiny_llama_dir, folder / "single.log")
    try:
        single_rate = run_few_shot(single.url)
    finally:
        stop_server(single)
    cache_aware = run_few_shot(dp_server.url)
    extra = ("--dp", "2", "--router-policy", "round-robin")
    round_robin_server = start_server(tiny_llama_dir, folder / "round_robin.log", *extra)
    try:
        round_robin = run_few_shot(round_robin_server.url)
    finally:
        stop_server(round_robin_server)
    print(
        f"\ncached-token hit rate, {PREFIXES} prefixes x {QUESTIONS} questions: --dp 1 {single_rate:.3f}, "
        f"--dp 2 cache-aware {cache_aware:.3f}, --dp 2 round-robin {round_robin:.3f}"
    )
    assert cache_aware >= single_rate - 0.05
    assert round_robin < cache_aware - 0.02
    served = [r["in_flight_requests"] for r in server_info(dp_server.url)["replicas"]]
    assert served == [0, 0]


def test_health_flush_metrics_and_info_cover_both_replicas(dp_server):
    url = dp_server.url
    assert generate(url, "Task 9: warm both caches.").status_code == 200
    health = httpx.get(url + "/health", timeout=30)
    assert health.status_code == 200
    assert sorted(health.json()["replica_heartbeat_age_s"]) == ["0", "1"]
    info = server_info(url)
    assert [r["replica"] for r in info["replicas"]] == [0, 1]
    assert all(r["alive"] and r["pid"] > 0 for r in info["replicas"])
    assert [r["replica"] for r in info["scheduler"]["replicas"]] == [0, 1]
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    assert [r["cache_tokens"] for r in server_info(url)["scheduler"]["replicas"]] == [0, 0]
    metrics = httpx.get(url + "/metrics", timeout=30).text
    for replica in ("0", "1"):
        assert f'spruce_replica_up{{replica="{replica}"}} 1.0' in metrics
        assert f'spruce_replica_kv_usage_ratio{{replica="{replica}"}}' in metrics
    assert 'spruce_replica_requests_total{replica="' in metrics
    assert "spruce_kv_slots_total " in metrics  # the totals stay unlabelled


def test_a_killed_replica_fails_only_its_own_requests(dp_server):
    url = dp_server.url
    prompts = [f"Story {i}: once upon a time there was a number {i * 7}." for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(generate, url, p, 900, ignore_eos=True) for p in prompts]
        in_flight = wait_for_both_busy(url)
        os.kill(in_flight[1]["pid"], signal.SIGKILL)
        responses = [f.result() for f in futures]
    statuses = sorted(r.status_code for r in responses)
    print(
        f"\nin flight at the kill: {[r['in_flight_requests'] for r in in_flight]}; statuses {statuses}"
    )
    assert statuses.count(503) == in_flight[1]["in_flight_requests"]
    assert statuses.count(200) == in_flight[0]["in_flight_requests"]
    assert all(
        "replica 1" in r.json()["error"]["message"] for r in responses if r.status_code == 503
    )
    info = server_info(url)["replicas"]
    assert [r["alive"] for r in info] == [True, False]
    assert all(generate(url, p).status_code == 200 for p in prompts[:3])  # served by the other
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert 'spruce_replica_up{replica="1"} 0.0' in httpx.get(url + "/metrics", timeout=30).text


def wait_for_both_busy(url: str, timeout: float = 30.0) -> list[dict]:
    """/server_info's replicas once all 8 requests are in flight, on both replicas."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replicas = server_info(url)["replicas"]
        counts = [r["in_flight_requests"] for r in replicas]
        if sum(counts) == 8 and all(counts):
            return replicas
        time.sleep(0.05)
    raise AssertionError(f"the 8 requests did not start on both replicas: {replicas}")


def test_exit_on_replica_death(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp_exit") / "server.log"
    server = start_server(tiny_llama_dir, log, "--dp", "2", "--exit-on-replica-death")
    os.kill(server_info(server.url)["replicas"][0]["pid"], signal.SIGKILL)
    assert server.proc.wait(30) == 1
    assert "scheduler replica 0" in server.log()
