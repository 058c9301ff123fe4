"""Fairness: a stream's pace beside a heavy client, against the same stream on a quiet server.

Starts `spruce serve` (the engine flags given here go to it) and runs, each against a
quiet run of the same light traffic:

- `embeddings`: a greedy stream of --stream-tokens tokens beside one /v1/embeddings call of
  --inputs inputs x --input-tokens token ids from another client (the stream starts once the
  call is in flight; the call is dropped, which aborts it, once the stream has ended).
- `soak`: --chatters clients chat (short prompts, --chat-tokens streamed, one after another)
  for --soak-s seconds while one heavy client sends embeddings batches and long prompts.

Clients are told apart by their address (the server's per-client limits and prefill shares
count by it): each connects from its own loopback address (127.0.0.2, ...). Prints the light
traffic's TTFT and inter-token gaps (p50 / p99 / max) loaded and quiet, their ratio, and
/health's answers during the loaded runs (it should stay 200). `--quick` shrinks the call
(16 x 500) and the soak (15 s).

    spruce bench fairness --num-threads 2 [--max-step-ms 250] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from spruce.runtime.bench import write_json
from spruce.runtime.bench.serving import percentiles
from spruce.runtime.executor.distributed import free_port

USES_ENGINE = True  # the engine flags go to the server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="embeddings,soak", help="embeddings,soak")
    parser.add_argument("--inputs", type=int, default=64, help="inputs of the embeddings call")
    parser.add_argument("--input-tokens", type=int, default=2000, help="token ids of each input")
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--chatters", type=int, default=8)
    parser.add_argument("--chat-tokens", type=int, default=64)
    parser.add_argument("--soak-s", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="16 x 500 inputs, a 15 s soak")
    parser.add_argument("--output-json", default=None)


@dataclass
class Stream:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0


def run(args: argparse.Namespace, engine_options: dict) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.quick:
        args.inputs, args.input_tokens, args.soak_s = 16, 500, 15.0
    with server(engine_options) as url:
        results = asyncio.run(_workloads(args, url))
    print(json.dumps(results, indent=2))
    write_json(args.output_json, results)
    return 0


async def _workloads(args: argparse.Namespace, url: str) -> dict:
    out = {
        "engine_options": "see the server's /server_info",
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }
    async with client(url, 1) as http:
        args.model = (await http.get("/v1/models")).json()["data"][0]["id"]
    await stream_once(client(url, 1), args.stream_tokens)  # warm-up
    if "embeddings" in args.workloads:
        quiet = await stream_once(client(url, 1), args.stream_tokens)
        loaded, health = await beside(url, lambda: stream_once(client(url, 1), args.stream_tokens),
                                      lambda: embeddings_call(url, args))  # fmt: skip
        out["embeddings"] = compare([quiet], [loaded], health)
        out["embeddings"]["stream_seconds"] = {"quiet": quiet.seconds, "loaded": loaded.seconds}
    if "soak" in args.workloads:
        quiet = await chatters(url, args)
        loaded, health = await beside(
            url, lambda: chatters(url, args), lambda: heavy_soak(url, args)
        )
        out["soak"] = compare(quiet, loaded, health)
    return out


# -- the server --------------------------------------------------------------------------------


@contextlib.contextmanager
def server(engine_options: dict) -> Iterator[str]:
    port, zmq_port = free_port(), free_port()
    flags = []
    for name, value in engine_options.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [] if value is False else [flag, str(value)]
    command = [sys.executable, "-m", "spruce.runtime", "serve", "--port", str(port),
               "--zmq-port", str(zmq_port), *flags]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


def client(url: str, address: int):
    """An HTTP client connecting from 127.0.0.<address + 1>: a client of its own."""
    import httpx

    transport = httpx.AsyncHTTPTransport(local_address=f"127.0.0.{address + 1}")
    return httpx.AsyncClient(base_url=url, transport=transport, timeout=None)


# -- traffic -----------------------------------------------------------------------------------


async def stream_once(http, tokens: int, prompt_len: int = 32, seed: int = 0) -> Stream:
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": params, "stream": True}
    result, start, last = Stream(), time.perf_counter(), None
    async with http, http.stream("POST", "/generate", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            n = len(json.loads(line[6:]).get("output_ids", []))
            now = time.perf_counter()
            if n and last is None:
                result.ttft = now - start
            elif n:
                result.gaps += [(now - last) / n] * n
            result.tokens += n
            last = now if n else last
    result.seconds = time.perf_counter() - start
    return result


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


async def embeddings_call(url: str, args: argparse.Namespace) -> str:
    rng = random.Random(1)
    inputs = [_ids(rng, args.input_tokens) for _ in range(args.inputs)]
    async with client(url, 2) as http:
        response = await http.post("/v1/embeddings", json={"model": args.model, "input": inputs})
    return f"{response.status_code} {response.text[:200]}"


async def heavy_soak(url: str, args: argparse.Namespace) -> None:
    """Embeddings batches and long prompts, one call after another, until cancelled."""
    rng = random.Random(2)
    async with client(url, 2) as http:
        for i in range(1_000_000):
            if i % 2 == 0:
                body = {
                    "model": args.model,
                    "input": [_ids(rng, args.input_tokens) for _ in range(8)],
                }
                response = await http.post("/v1/embeddings", json=body)
            else:
                prompts = [_ids(rng, args.input_tokens) for _ in range(8)]
                body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 8}}
                response = await http.post("/generate", json=body)
            if response.status_code in (429, 503):
                await asyncio.sleep(float(response.headers.get("Retry-After", 1)))


async def chatters(url: str, args: argparse.Namespace) -> list[Stream]:
    """--chatters clients, each streaming chats one after another for --soak-s seconds."""
    end = time.perf_counter() + args.soak_s

    async def chat(who: int) -> list[Stream]:
        done, seed = [], who * 1000
        while time.perf_counter() < end:
            seed += 1
            done.append(await stream_once(client(url, 10 + who), args.chat_tokens, seed=seed))
        return done

    runs = await asyncio.gather(*(chat(i) for i in range(args.chatters)))
    return [s for streams in runs for s in streams]


async def beside(url: str, light, heavy) -> tuple:
    """Runs `light()` once `heavy()` is in flight, then drops `heavy`; /health is asked every
    second meanwhile: (light's result, /health's statuses and seconds)."""
    work = asyncio.ensure_future(heavy())
    await asyncio.sleep(2.0)  # the heavy call is in the scheduler
    probes: list[tuple[int, float]] = []
    watch = asyncio.ensure_future(_watch_health(url, probes))
    try:
        result = await light()
    finally:
        watch.cancel()
        if work.done():  # the heavy work should outlast the light: say so when it did not
            print("the heavy work ended first:", work.exception() or work.result(), file=sys.stderr)
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await work
    return result, probes


async def _watch_health(url: str, probes: list[tuple[int, float]]) -> None:
    async with client(url, 3) as http:
        while True:
            start = time.perf_counter()
            status = (await http.get("/health")).status_code
            probes.append((status, time.perf_counter() - start))
            await asyncio.sleep(1.0)


# -- report ------------------------------------------------------------------------------------


def compare(quiet: list[Stream], loaded: list[Stream], health: list[tuple[int, float]]) -> dict:
    def summary(streams: list[Stream]) -> dict:
        gaps = [g for s in streams for g in s.gaps]
        return {
            "streams": len(streams), "ttft_p50": percentiles([s.ttft for s in streams])["p50"],
            "ttft_p99": percentiles([s.ttft for s in streams])["p99"],
            "gap_p50": percentiles(gaps)["p50"], "gap_p99": percentiles(gaps)["p99"],
            "gap_max": max(gaps, default=0.0),
        }  # fmt: skip

    q, b = summary(quiet), summary(loaded)
    ratio = {k: round(b[k] / q[k], 2) if q[k] else None for k in q if k != "streams"}
    statuses = [s for s, _ in health]
    return {
        "quiet": q, "loaded": b, "loaded_over_quiet": ratio,
        "health": {"probes": len(health), "not_200": sum(s != 200 for s in statuses),
                   "seconds_max": max((t for _, t in health), default=0.0)},
    }  # fmt: skip
