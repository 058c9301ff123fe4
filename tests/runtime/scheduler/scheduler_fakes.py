"""A scheduler without a model: the real Scheduler, managers, slot allocator, request
table and prefix cache, with a fake step that "samples" a token computed from the request's
length. Nothing here runs a forward pass."""

from __future__ import annotations

import itertools

import torch

from spruce.radix import NoPrefixCache, RadixCache
from spruce.runtime.config import SchedulerOptions
from spruce.runtime.core.request import Req
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.executor.kv_pool import ReqToTokenTable, SlotAllocator
from spruce.runtime.scheduler.cache import CacheManager
from spruce.runtime.scheduler.output import Sampled, ScheduleOutput
from spruce.runtime.scheduler.scheduler import Scheduler
from spruce.runtime.text.stop import StopChecker

EOS = 2
_rids = itertools.count()


class CharTokenizer:
    """Token id t decodes to chr(t): enough for stop strings."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in ids)


def make_scheduler(
    num_slots: int = 512, max_requests: int = 8, radix: bool = True, **options
) -> Scheduler:
    allocator = SlotAllocator(num_slots)
    table = ReqToTokenTable(max_requests, 256)
    cache = RadixCache(allocator) if radix else NoPrefixCache(allocator)
    manager = CacheManager(allocator, table, cache)
    return Scheduler(
        SchedulerOptions(**options), manager, StopChecker(CharTokenizer(), frozenset({EOS}))
    )


def make_req(prompt: list[int] | int, max_new_tokens: int = 4, **sampling) -> Req:
    ids = list(range(10, 10 + prompt)) if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **sampling)
    return Req(rid=f"r{next(_rids)}", prompt_ids=ids, sampling=params)


def next_token(req: Req) -> int:
    """What the fake model samples: depends only on the request's length (never EOS)."""
    return 100 + req.total_len % 50


def fake_forward(scheduler: Scheduler, out: ScheduleOutput) -> None:
    """What the model runner does to the bookkeeping: the new tokens' slots go into their
    rows of the request-to-token table (before the pass runs, so also when it fails)."""
    for item in out.scheduled:
        scheduler.cache.table.write(item.req.row, item.req.computed_len, item.slots)


def fake_sample(out: ScheduleOutput, errors: dict[Req, str] | None = None) -> None:
    """Sets each scheduled request's result to what a model would sample (the requests in
    `errors` failed: their row's error, no token)."""
    errors = errors or {}
    for item in out.scheduled:
        error = errors.get(item.req)
        token = next_token(item.req) if item.samples and error is None else None
        item.result = Sampled(token_id=token, error=error)


def fail_step(scheduler: Scheduler, error: Exception) -> list[Req]:
    """One schedule whose forward pass raises; returns the requests aborted for it."""
    out = scheduler.schedule()
    scheduler.pop_finished_outside_step()
    fake_forward(scheduler, out)
    return scheduler.step_failed(out, error)


def step(scheduler: Scheduler, seconds_of=None) -> ScheduleOutput:
    """One schedule + update with the fake model; checks the pool accounting after it.
    `seconds_of(out)`: the step's seconds, reported to the scheduler (its measured pace)."""
    out = scheduler.schedule()
    scheduler.pop_finished_outside_step()
    if out:
        fake_forward(scheduler, out)
        fake_sample(out)
        scheduler.update(out)
        if seconds_of is not None:
            scheduler.record_step(out, seconds_of(out))
    scheduler.check_integrity()
    return out


def run_to_end(scheduler: Scheduler, max_steps: int = 500) -> int:
    steps = 0
    while scheduler.has_work():
        step(scheduler)
        steps += 1
        assert steps < max_steps, "the scheduler does not make progress"
    return steps


def used_slots(scheduler: Scheduler) -> int:
    allocator = scheduler.cache.allocator
    return allocator.capacity - allocator.num_free


def row_slots(scheduler: Scheduler, req: Req, start: int, end: int) -> torch.Tensor:
    return scheduler.cache.table.read(req.row, end, start)
