"""Serving benchmark: an asyncio load generator against a running `spruce serve`.

Sends N streaming requests (synthetic token-id prompts, greedy, ignore_eos so every request
makes exactly --output-len tokens) to /generate or /v1/completions, with Poisson arrivals
at --request-rate and/or at most --max-concurrency in flight. Reports request throughput,
output tokens/s, TTFT / inter-token / end-to-end latency percentiles and the prefix-cache
hit rate (the server's cached / prompt tokens over the run, all replicas together).

`--shared-prefixes K` puts one of K few-shot prefixes (`--prefix-len` tokens) before each
prompt, in turn: the workload of data-parallel routing (`spruce serve --dp 2`, cache-aware
vs `--router-policy round-robin`, vs `--dp 1`).

`--compare-offline` then runs the same requests through the offline Engine in this process
(at most --max-concurrency running at once, the server idle meanwhile) and prints the
serving / offline output tokens/s ratio:

    spruce serve --num-threads 2 &
    spruce bench serving --base-url http://127.0.0.1:30000 --max-concurrency 16 \\
        --num-prompts 64 --compare-offline --num-threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

from spruce.runtime.bench import write_json
from spruce.runtime.bench.offline import synthetic_prompts

USES_ENGINE = True  # the engine flags configure the --compare-offline run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:30000")
    parser.add_argument("--api", choices=["generate", "completions"], default="generate")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: all at once)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    parser.add_argument("--input-len-min", type=int, default=64)
    parser.add_argument("--input-len-max", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--prompt-seed", type=int, default=0, help="seed of the synthetic prompts and arrivals"
    )
    parser.add_argument(
        "--shared-prefixes",
        type=int,
        default=0,
        help="prompts start with one of this many prefixes (0: none)",
    )
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens of each shared prefix")
    parser.add_argument(
        "--compare-offline",
        action="store_true",
        help="also run the requests through the offline Engine",
    )
    parser.add_argument("--output-json", default=None)


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gap before each later token
    error: str = ""


# -- client ------------------------------------------------------------------------------------


class Client:
    def __init__(self, args: argparse.Namespace, model: str) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
        self.http = httpx.AsyncClient(
            base_url=args.base_url, headers=headers, timeout=None, limits=limits
        )
        self.api = args.api
        self.model = model
        self.output_len = args.output_len

    async def run(self, prompt: list[int]) -> RequestResult:
        path, body = self._request(prompt)
        start = time.perf_counter()
        result = RequestResult(ok=True)
        last = None
        try:
            async with self.http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    return RequestResult(ok=False, error=(await response.aread()).decode()[:200])
                async for line in response.aiter_lines():
                    if '"usage":{' in line:  # completions: the exact count comes last
                        result.output_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                        continue
                    n = self._new_tokens(line)
                    if not n:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl += [(now - last) / n] * n
                    result.output_tokens += n
                    last = now
        except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
            return RequestResult(ok=False, error=repr(e))
        result.e2e = time.perf_counter() - start
        return result

    def _request(self, prompt: list[int]) -> tuple[str, dict]:
        if self.api == "generate":
            params = {"max_new_tokens": self.output_len, "temperature": 0, "ignore_eos": True}
            return "/generate", {"input_ids": prompt, "sampling_params": params, "stream": True}
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": self.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        return "/v1/completions", body

    def _new_tokens(self, line: str) -> int:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return 0
        data = json.loads(line[6:])
        if self.api == "generate":
            return len(data.get("output_ids", []))
        return len(data["choices"])  # a chunk per scheduler update: one token, but for jump-forward

    async def close(self) -> None:
        await self.http.aclose()


async def run_load(
    client: Client, prompts: list[list[int]], rate: float, concurrency: int | None, seed: int
):
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency or len(prompts))

    async def one(prompt):
        async with gate:
            return await client.run(prompt)

    tasks = []
    start = time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.ensure_future(one(prompt)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


# -- report ------------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def with_shared_prefixes(
    tokenizer, prompts: list[list[int]], args: argparse.Namespace
) -> list[list[int]]:
    """Each prompt gets one of --shared-prefixes prefixes (seeded random tokens), picked at
    random (a fixed cycle would line up with round-robin routing and flatter it)."""
    if args.shared_prefixes <= 0:
        return prompts
    length = args.prefix_len
    prefixes = synthetic_prompts(
        tokenizer, args.shared_prefixes, length, length, args.prompt_seed + 1
    )
    rng = random.Random(args.prompt_seed + 2)
    return [rng.choice(prefixes) + p for p in prompts]


def hit_rate(before: dict, after: dict) -> float:
    """Share of the run's prompt tokens the server found in its prefix cache(s)."""
    prompt = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    cached = after["cached_prompt_tokens_total"] - before["cached_prompt_tokens_total"]
    return cached / max(prompt, 1)


def summarize(results: list[RequestResult], seconds: float, prompts: list[list[int]]) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    return {
        "seconds": seconds,
        "completed": len(done),
        "failed": len(results) - len(done),
        "first_error": next((r.error for r in results if not r.ok), None),
        "requests_per_s": len(done) / seconds,
        "input_tokens_per_s": sum(len(p) for p, r in zip(prompts, results) if r.ok) / seconds,
        "output_tokens_per_s": out_tokens / seconds,
        "output_tokens": out_tokens,
        "ttft_s": percentiles([r.ttft for r in done]),
        "itl_s": percentiles([x for r in done for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in done]),
    }


def print_report(r: dict) -> None:
    s = r["serving"]
    print(
        f"requests              {s['completed']} completed, {s['failed']} failed in {s['seconds']:.2f} s"
    )
    if s["first_error"]:
        print(f"first error           {s['first_error']}")
    print(f"request throughput    {s['requests_per_s']:.3f} req/s")
    print(f"input tokens/s        {s['input_tokens_per_s']:.1f}")
    print(f"output tokens/s       {s['output_tokens_per_s']:.1f}  ({s['output_tokens']} tokens)")
    print(f"prefix cache hit rate {s['cache_hit_rate']:.3f}  (server: {s['replicas']})")
    for name, key in (
        ("TTFT", "ttft_s"),
        ("inter-token latency", "itl_s"),
        ("end-to-end latency", "e2e_s"),
    ):
        ms = {k: v * 1e3 for k, v in s[key].items()}
        print(
            f"{name:<22}mean {ms['mean']:.1f} ms, p50 {ms['p50']:.1f}, p90 {ms['p90']:.1f}, p99 {ms['p99']:.1f}"
        )
    if "offline" in r:
        offline = r["offline"]
        print(
            f"offline Engine        {offline['output_tokens_per_s']:.1f} output tokens/s "
            f"(same requests, at most {offline['max_running_requests']} running)"
        )
        print(f"serving / offline     {r['serving_over_offline']:.3f}")


# -- offline peer ------------------------------------------------------------------------------


def run_offline(
    args: argparse.Namespace, engine_options: dict, model_path: str, prompts: list[list[int]]
) -> dict:
    from spruce.runtime.engine.offline import Engine

    options = dict(engine_options)
    options.setdefault("model_path", model_path)
    options["max_running_requests"] = args.max_concurrency or options.get(
        "max_running_requests", 128
    )
    engine = Engine(**options)
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    engine.generate(
        input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4}
    )  # warm-up
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "max_running_requests": options["max_running_requests"]}  # fmt: skip


# -- entry point -------------------------------------------------------------------------------


async def _serving(args: argparse.Namespace) -> tuple[dict, list[list[int]], dict]:
    import httpx

    from spruce.runtime.models.loading.files import load_tokenizer

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=30) as http:
        server = (await http.get("/server_info")).raise_for_status().json()
        info = {**server["model"], "model_path": server["model_path"]}  # /model_info has no path
        tokenizer = load_tokenizer(info["model_path"])
        lengths = (args.input_len_min, args.input_len_max)
        prompts = synthetic_prompts(tokenizer, args.num_prompts, *lengths, args.prompt_seed)
        prompts = with_shared_prefixes(tokenizer, prompts, args)
        client = Client(args, info["model"])
        await run_load(client, prompts[:2], math.inf, None, args.prompt_seed)  # warm-up
        await http.post("/flush_cache")
        before = (await http.get("/server_info")).json()["scheduler"]
        results, seconds = await run_load(
            client, prompts, args.request_rate, args.max_concurrency, args.prompt_seed
        )
        after = (await http.get("/server_info")).json()["scheduler"]
        await client.close()
    summary = summarize(results, seconds, prompts)
    summary["cache_hit_rate"] = hit_rate(before, after)
    summary["replicas"] = _replicas_line(server["server_options"])
    return summary, prompts, info


def _replicas_line(options: dict) -> str:
    dp = options.get("dp", 1)
    return "1 replica" if dp == 1 else f"{dp} replicas, {options.get('router_policy')} routing"


def run(args: argparse.Namespace, engine_options: dict) -> int:
    serving, prompts, info = asyncio.run(_serving(args))
    config = {k: (None if v == math.inf else v) for k, v in vars(args).items() if k != "func"}
    result = {"config": config, "model": info["model"], "serving": serving}
    if args.compare_offline:
        result["offline"] = run_offline(args, engine_options, info["model_path"], prompts)
        offline_rate = result["offline"]["output_tokens_per_s"]
        result["serving_over_offline"] = serving["output_tokens_per_s"] / offline_rate
    print_report(result)
    write_json(args.output_json, result)
    return 0 if serving["failed"] == 0 else 1
