"""Soak (issue 13): 500 requests from 32 concurrent clients on the tiny model, mixed
streaming / non-streaming / constrained / OpenAI chat / DSL over ZeroMQ, 10% abandoned
mid-stream and 5% bad inputs. Every good request completes correctly, the server stays
healthy, and afterwards the KV pool is back at its idle level and the front end's memory
has not grown. Prints the figures."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest
from test_server import API_KEY, AUTH, child_pids, start_server, stop_server

pytestmark = pytest.mark.slow

REQUESTS, CLIENTS = 500, 32
TOKENS = 8
PARAMS = {"max_new_tokens": TOKENS, "temperature": 0.7, "ignore_eos": True}
BAD = [
    {"text": "x", "sampling_params": {"temperature": 1e-40}},
    {"text": "x", "sampling_params": {"top_p": 0}},
    {"text": "x", "sampling_params": {"stop_token_ids": [10**12]}},
    {"text": "x", "top_logprobs_num": 99},
    {"input_ids": []},
]
GOOD_KINDS = ("generate", "stream", "regex", "chat", "dsl")


def kind_of(i: int) -> str:
    if i % 20 == 0:
        return "bad"  # 5%
    if i % 10 == 1:
        return "abandon"  # 10%
    return GOOD_KINDS[i % len(GOOD_KINDS)]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    srv = start_server(
        tiny_llama_dir, tmp_path_factory.mktemp("soak") / "server.log", "--api-key", API_KEY
    )
    yield srv
    assert stop_server(srv) == 0, srv.log()


class Soak:
    def __init__(self, server, model_name: str, endpoint) -> None:
        self.server, self.model_name, self.endpoint = server, model_name, endpoint
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []
        self.transport_retries = 0

    async def run(self, http: httpx.AsyncClient) -> None:
        jobs: asyncio.Queue[int] = asyncio.Queue()
        for i in range(REQUESTS):
            jobs.put_nowait(i)

        async def client() -> None:
            while not jobs.empty():
                i = jobs.get_nowait()
                kind = kind_of(i)
                try:
                    await self.attempt(kind, http, i)
                    self.counts[kind] = self.counts.get(kind, 0) + 1
                except Exception as e:  # noqa: BLE001 - every failure is reported at the end
                    self.failures.append(f"{kind} #{i}: {e!r}")

        await asyncio.gather(*(client() for _ in range(CLIENTS)))

    async def attempt(self, kind: str, http, i: int) -> None:
        """One job; a request that met a pooled keep-alive connection the server had just
        closed (a transport race every HTTP client retries) is sent once more, and counted."""
        try:
            await getattr(self, kind)(http, i)
        except httpx.RemoteProtocolError:
            if kind == "abandon":
                raise
            self.transport_retries += 1
            await getattr(self, kind)(http, i)

    async def generate(self, http, i: int) -> None:
        r = await http.post(
            "/generate", json={"text": f"request {i}", "sampling_params": {**PARAMS, "seed": i}}
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == TOKENS

    async def stream(self, http, i: int) -> None:
        body = {"text": f"stream {i}", "sampling_params": {**PARAMS, "seed": i}, "stream": True}
        chunks = await sse_chunks(http, body)
        assert sum(len(c["output_ids"]) for c in chunks) == TOKENS and chunks[-1]["finished"]

    async def regex(self, http, i: int) -> None:
        params = {"regex": "[0-9]{3}-[a-z]{2}", "max_new_tokens": 20, "temperature": 0.8, "seed": i}
        r = await http.post("/generate", json={"text": f"code {i}:", "sampling_params": params})
        assert r.status_code == 200, r.text
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.json()["text"]), r.json()["text"]

    async def chat(self, http, i: int) -> None:
        body = {
            "model": self.model_name, "messages": [{"role": "user", "content": f"hello {i}"}],
            "max_tokens": TOKENS, "ignore_eos": True, "seed": i,
        }  # fmt: skip
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == TOKENS

    async def dsl(self, http, i: int) -> None:
        from spruce.runtime.protocol.dsl import GenerateMsg

        msg = GenerateMsg(f"dsl-{i}", text=f"dsl {i}", sampling_params={**PARAMS, "seed": i})
        final = await asyncio.to_thread(self.endpoint.generate, msg)
        assert len(final.output_ids) == TOKENS

    async def abandon(self, http, i: int) -> None:
        body = {
            "text": f"abandon {i}",
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
            "stream": True,
        }
        async with http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # leave mid-stream: the connection closes with the response

    async def bad(self, http, i: int) -> None:
        r = await http.post("/generate", json=BAD[(i // 20) % len(BAD)])
        assert r.status_code == 400, r.text


async def sse_chunks(http, body: dict) -> list[dict]:
    chunks = []
    async with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def idle_slots(url: str) -> int:
    deadline = time.monotonic() + 60
    while httpx.post(url + "/flush_cache", headers=AUTH, timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the server stayed busy"
        time.sleep(0.1)
    return httpx.get(url + "/server_info", headers=AUTH, timeout=30).json()["scheduler"][
        "kv_slots_used"
    ]


def test_soak(server, tiny_llama_dir):
    import spruce.lang as sl

    idle = idle_slots(server.url)
    pids = [server.proc.pid, *child_pids(server.proc.pid)]
    endpoint = sl.RuntimeEndpoint(server.zmq_url, api_key=API_KEY)
    soak = Soak(server, tiny_llama_dir.name, endpoint)

    async def main():
        limits = httpx.Limits(max_connections=CLIENTS + 4)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=120, limits=limits
        ) as http:
            await soak.run(http)

    started = time.monotonic()
    front_before = rss_kb(server.proc.pid)
    try:
        asyncio.run(main())
    finally:
        endpoint.close()
    seconds = time.monotonic() - started
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    leaked = idle_slots(server.url) - idle
    info = httpx.get(server.url + "/server_info", headers=AUTH, timeout=30).json()
    front_growth_mb = (rss_kb(server.proc.pid) - front_before) / 1024
    peak_mb = sum(rss_kb(pid, "VmHWM") for pid in pids) / 1024
    good = sum(v for k, v in soak.counts.items() if k in GOOD_KINDS)
    print(
        f"\nsoak: {REQUESTS} requests from {CLIENTS} clients in {seconds:.1f} s: {good} good, "
        f"{soak.counts.get('abandon', 0)} disconnects, {soak.counts.get('bad', 0)} bad inputs, "
        f"{len(soak.failures)} failures, {soak.transport_retries} transport retries; leaked slots {leaked}; peak RSS {peak_mb:.0f} MB "
        f"(front end + scheduler); front-end RSS growth {front_growth_mb:+.1f} MB"
    )
    for failure in soak.failures[:10]:
        print("  failed:", failure)
    assert soak.failures == [], soak.failures[:10]
    assert soak.transport_retries <= 3
    assert soak.counts.get("abandon") == REQUESTS // 10 and soak.counts.get("bad") == REQUESTS // 20
    assert leaked == 0 and info["in_flight_requests"] == 0
    assert front_growth_mb < 100
