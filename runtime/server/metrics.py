"""Prometheus metrics (a registry of the server's own, not the global one), the
one-line-per-request log and the periodic throughput log."""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

logger = logging.getLogger("spruce.server")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """Counters are fed by the request manager as requests finish; gauges are refreshed
    from the scheduler's stats on every scrape (`refresh`)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "spruce_requests", "finished requests", ["finish_reason"], registry=registry
        )
        self.prompt_tokens = Counter(
            "spruce_prompt_tokens", "prompt tokens of finished requests", registry=registry
        )
        self.generation_tokens = Counter(
            "spruce_generation_tokens", "generated tokens", registry=registry
        )
        self.cached_tokens = Counter(
            "spruce_cached_tokens", "prompt tokens served from the prefix cache", registry=registry
        )
        self.ttft = Histogram(
            "spruce_time_to_first_token_seconds", "arrival -> first token",
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.itl = Histogram(
            "spruce_inter_token_latency_seconds", "mean time between output tokens, per request",
            buckets=ITL_BUCKETS, registry=registry,
        )  # fmt: skip
        self.e2e = Histogram(
            "spruce_e2e_request_latency_seconds", "arrival -> finish",
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.spec_draft = Counter(
            "spruce_spec_draft_tokens", "tokens drafted by speculative decoding", registry=registry
        )
        self.spec_accepted = Counter(
            "spruce_spec_accepted_tokens", "drafted tokens accepted", registry=registry
        )
        self.spec_acceptance = Histogram(
            "spruce_spec_acceptance_ratio", "accepted / drafted tokens, per request that drafted",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=registry,
        )  # fmt: skip
        self.running = Gauge("spruce_running_requests", "requests running", registry=registry)
        self.waiting = Gauge("spruce_waiting_requests", "requests waiting", registry=registry)
        self.kv_used = Gauge(
            "spruce_kv_slots_used", "KV slots in use, cached ones included", registry=registry
        )
        self.kv_total = Gauge(
            "spruce_kv_slots_total", "KV pool size in token slots", registry=registry
        )
        self.kv_usage = Gauge("spruce_kv_usage_ratio", "KV slots used / total", registry=registry)
        self.kv_locked = Gauge(
            "spruce_kv_locked_tokens", "cached tokens held by running requests", registry=registry
        )
        self.zmq_bad_frames = Counter(
            "spruce_zmq_bad_frames", "malformed ZeroMQ frames, answered with an error or dropped (no rid)",
            ["outcome"], registry=registry,
        )  # fmt: skip
        self.task_restarts = Counter(
            "spruce_task_restarts",
            "front-end tasks restarted after a failure",
            ["task"],
            registry=registry,
        )
        self.refused = Counter(
            "spruce_refused_requests", "calls refused for load: 503 full, 429 per-client cap", ["status"],
            registry=registry,
        )  # fmt: skip
        self._add_replica_metrics(registry)
        self.window = Window()

    def _add_replica_metrics(self, registry: CollectorRegistry) -> None:
        """The same figures per scheduler replica (--dp), under a `replica` label; the
        unlabelled ones above are the totals."""
        by_replica = ["replica"]
        self.replica_requests = Counter(
            "spruce_replica_requests",
            "finished requests, by replica",
            by_replica,
            registry=registry,
        )
        self.replica_prompt_tokens = Counter(
            "spruce_replica_prompt_tokens", "prompt tokens of finished requests, by replica", by_replica,
            registry=registry,
        )  # fmt: skip
        self.replica_cached_tokens = Counter(
            "spruce_replica_cached_tokens", "prompt tokens served from the prefix cache, by replica", by_replica,
            registry=registry,
        )  # fmt: skip
        self.replica_up = Gauge(
            "spruce_replica_up", "1 while the replica is alive", by_replica, registry=registry
        )
        self.replica_running = Gauge(
            "spruce_replica_running_requests",
            "requests running, by replica",
            by_replica,
            registry=registry,
        )
        self.replica_waiting = Gauge(
            "spruce_replica_waiting_requests",
            "requests waiting, by replica",
            by_replica,
            registry=registry,
        )
        self.replica_kv_usage = Gauge(
            "spruce_replica_kv_usage_ratio",
            "KV slots used / total, by replica",
            by_replica,
            registry=registry,
        )

    # -- feeding ------------------------------------------------------------------------------

    def on_finished(self, state, event, update) -> None:
        meta = event.result["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type", "unknown")
        prompt, completion, cached = (
            meta["prompt_tokens"],
            meta["completion_tokens"],
            meta["cached_tokens"],
        )
        latency = time.perf_counter() - state.call.started
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(cached)
        replica = str(state.replica)
        self.replica_requests.labels(replica).inc()
        self.replica_prompt_tokens.labels(replica).inc(prompt)
        self.replica_cached_tokens.labels(replica).inc(cached)
        self.e2e.observe(latency)
        done = update.finished
        if done.spec_draft_tokens:
            self.spec_draft.inc(done.spec_draft_tokens)
            self.spec_accepted.inc(done.spec_accepted_tokens)
            self.spec_acceptance.observe(done.spec_accepted_tokens / done.spec_draft_tokens)
        decode_s = update.finished.decode_s
        if decode_s is not None:
            self.ttft.observe(max(latency - decode_s, 0.0))
            if completion > 1:
                self.itl.observe(decode_s / (completion - 1))
        self.window.add()
        logger.info(
            "finished %s: prompt %d, completion %d, cached %d tokens, %.3f s, %s",
            state.client_rid,
            prompt,
            completion,
            cached,
            latency,
            reason,
        )

    def on_failed(self, state, message: str, status: int) -> None:
        self.requests.labels("error").inc()
        logger.info("failed %s (%d): %s", state.client_rid, status, message)

    def refresh(self, stats: dict) -> None:
        self.running.set(stats["running_requests"])
        self.waiting.set(stats["waiting_requests"])
        self.kv_used.set(stats["kv_slots_used"])
        self.kv_total.set(stats["kv_slots_total"])
        self.kv_usage.set(stats["kv_slots_used"] / max(stats["kv_slots_total"], 1))
        self.kv_locked.set(stats["cache_locked_tokens"])
        for one in stats.get("replicas", [{**stats, "replica": 0}]):
            replica = str(one["replica"])
            self.replica_running.labels(replica).set(one["running_requests"])
            self.replica_waiting.labels(replica).set(one["waiting_requests"])
            self.replica_kv_usage.labels(replica).set(
                one["kv_slots_used"] / max(one["kv_slots_total"], 1)
            )

    def refresh_liveness(self, replicas) -> None:
        """`replicas`: replicas.Replica records (dead ones included)."""
        for replica in replicas:
            self.replica_up.labels(str(replica.index)).set(0 if replica.dead else 1)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # -- throughput log -------------------------------------------------------------------------

    async def log_throughput(self, period_s: float, fetch_stats, in_flight) -> None:
        """Every period while busy: finished requests/s, prompt and generated tokens/s (from
        the scheduler's counters), queue sizes and KV pool usage."""
        last = None
        while True:
            await asyncio.sleep(period_s)
            if not in_flight() and not self.window.requests:
                last = None
                continue
            try:
                stats = await fetch_stats()
            except Exception:  # noqa: BLE001 - scheduler busy or gone; the watchdog handles gone
                continue
            finished = self.window.take()
            if last is not None:
                _log_rates(last, stats, finished)
            last = stats


def _log_rates(before: dict, now: dict, finished: int) -> None:
    seconds = max(now["time"] - before["time"], 1e-9)
    prompt = now["prompt_tokens_total"] - before["prompt_tokens_total"]
    generated = now["generated_tokens_total"] - before["generated_tokens_total"]
    logger.info(
        "throughput: %.2f req/s, prompt %.1f tokens/s, generation %.1f tokens/s; running %d, waiting %d, "
        "KV pool %.1f%% used",
        finished / seconds,
        prompt / seconds,
        generated / seconds,
        now["running_requests"],
        now["waiting_requests"],
        100 * now["kv_slots_used"] / max(now["kv_slots_total"], 1),
    )


class Window:
    """Requests finished since the last `take()`."""

    def __init__(self) -> None:
        self.requests = 0

    def add(self) -> None:
        self.requests += 1

    def take(self) -> int:
        out, self.requests = self.requests, 0
        return out
