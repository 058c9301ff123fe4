"""The Scheduler and its managers without a model: token budget, chunked prefill,
retraction, rollback of failed steps, per-request faults. Every step checks the pool
accounting (scheduler_fakes.step)."""

from __future__ import annotations

import random

import pytest
import torch
from scheduler_fakes import (
    fail_step,
    fake_forward,
    fake_sample,
    make_req,
    make_scheduler,
    next_token,
    row_slots,
    run_to_end,
    step,
    used_slots,
)

from spruce.runtime.scheduler.faults import MAX_FAILURES_ALONE, RequestFault
from spruce.runtime.scheduler.output import ScheduleOutput

# -- budget and chunked prefill ------------------------------------------------------------------


def test_one_step_stays_within_the_token_budget_and_chunks_the_last_prompt():
    scheduler = make_scheduler(chunked_prefill_size=16, schedule_policy="fcfs")
    reqs = [make_req(10), make_req(10), make_req(10)]
    for req in reqs:
        scheduler.add(req)
    out = scheduler.schedule()
    assert out.num_tokens == 16
    assert [(s.req, s.num_tokens) for s in out.scheduled] == [(reqs[0], 10), (reqs[1], 6)]
    assert [s.samples for s in out.scheduled] == [True, False]  # a whole prompt samples
    assert reqs[2] in scheduler.waiting


def test_a_long_prompt_is_computed_in_chunks_then_decoded():
    scheduler = make_scheduler(chunked_prefill_size=16)
    req = make_req(40, max_new_tokens=3)
    scheduler.add(req)
    lens = [[s.num_tokens for s in step(scheduler).scheduled] for _ in range(5)]
    assert lens == [[16], [16], [8], [1], [1]]
    assert req.finished and req.finish_reason.type == "length"
    assert len(req.output_ids) == 3


def test_decode_and_a_prefill_chunk_share_a_step_and_decode_is_outside_the_prefill_budget():
    scheduler = make_scheduler(chunked_prefill_size=8)
    first = make_req(4, max_new_tokens=10)
    scheduler.add(first)
    step(scheduler)
    second = make_req(20)
    scheduler.add(second)
    out = step(scheduler)
    assert [(s.req, s.num_tokens) for s in out.scheduled] == [(first, 1), (second, 8)]


def test_prefill_first_runs_no_decode_while_prompts_wait():
    scheduler = make_scheduler(chunked_prefill_size=8, prefill_first=True)
    first = make_req(4, max_new_tokens=10)
    scheduler.add(first)
    step(scheduler)
    scheduler.add(make_req(20))
    assert first not in step(scheduler).reqs


def test_max_running_requests_caps_admission():
    scheduler = make_scheduler(max_running_requests=2)
    for _ in range(4):
        scheduler.add(make_req(3))
    assert len(step(scheduler).reqs) == 2 and len(scheduler.waiting) == 2
    run_to_end(scheduler)


# -- memory: retraction ------------------------------------------------------------------------


def test_a_request_taken_out_of_a_step_leaves_with_its_slots():
    out = ScheduleOutput()
    first, second = make_req(4), make_req(4)
    out.add(first, 4, torch.arange(4))
    out.add(second, 2, torch.arange(4, 6))
    assert out.remove(make_req(1)) is None  # not in this step: nothing to free
    assert out.remove(first).tolist() == [0, 1, 2, 3]
    assert out.reqs == [second] and out.num_tokens == 2 and len(out) == 1


def test_decode_retracts_the_newest_request_when_slots_run_out_and_all_finish():
    # 48 usable slots; two requests of 10 + 20 tokens need 60 at their ends
    scheduler = make_scheduler(num_slots=49, radix=False, decode_reserve_ratio=0.0)
    reqs = [make_req(10, max_new_tokens=20), make_req(10, max_new_tokens=20)]
    for req in reqs:
        scheduler.add(req)
    run_to_end(scheduler)
    assert scheduler.stats.retractions >= 1
    assert all(r.finish_reason.type == "length" and len(r.output_ids) == 20 for r in reqs)
    assert used_slots(scheduler) == 0


def test_outputs_do_not_depend_on_retraction():
    def outputs(num_slots):
        scheduler = make_scheduler(num_slots=num_slots, decode_reserve_ratio=0.0)
        reqs = [
            make_req([200 + 20 * i + k for k in range(12)], max_new_tokens=16) for i in range(3)
        ]
        for req in reqs:
            scheduler.add(req)
        run_to_end(scheduler)
        return [r.output_ids for r in reqs], scheduler.stats.retractions

    roomy, no_retraction = outputs(512)
    tight, retractions = outputs(60)
    assert no_retraction == 0 and retractions >= 1
    assert roomy == tight


# -- failed steps: rollback and suspects ------------------------------------------------------------


def test_a_failed_step_is_rolled_back_exactly():
    scheduler = make_scheduler(chunked_prefill_size=64)
    warm = make_req(8, max_new_tokens=10)
    scheduler.add(warm)
    step(scheduler)
    newcomer = make_req(list(range(10, 18)) + [90, 91])  # shares warm's cached prompt
    scheduler.add(newcomer)
    used_before = used_slots(scheduler)
    out = scheduler.schedule()
    computed = {r.rid: r.computed_len for r in (warm, newcomer)}
    assert out.reqs == [warm, newcomer]
    fake_forward(scheduler, out)
    assert scheduler.step_failed(out, RuntimeError("injected")) == []
    scheduler.check_integrity()
    assert used_slots(scheduler) == used_before  # the step's slots are back
    assert {r.rid: r.computed_len for r in (warm, newcomer)} == computed
    for item in out.scheduled:  # no row position refers to a freed slot
        req, slots = item.req, item.slots
        stale = row_slots(scheduler, req, req.computed_len, req.computed_len + slots.numel())
        assert not set(stale.tolist()) & set(slots.tolist())
    assert (
        newcomer in scheduler.running and newcomer.computed_len == 8
    )  # still admitted, prefix kept


def test_after_a_failed_step_each_request_runs_alone_once_then_batches_again():
    scheduler = make_scheduler()
    reqs = [make_req(5, max_new_tokens=6) for _ in range(3)]
    for req in reqs:
        scheduler.add(req)
    step(scheduler)
    fail_step(scheduler, RuntimeError("transient"))
    alone = [step(scheduler).reqs for _ in range(3)]
    assert alone == [[reqs[0]], [reqs[1]], [reqs[2]]]
    assert step(scheduler).reqs == reqs  # cleared: one batch again
    run_to_end(scheduler)
    assert all(r.finish_reason.type == "length" for r in reqs)
    assert all(r.output_ids == reference_output(5, 6) for r in reqs)
    assert used_slots(scheduler) == scheduler.cache.prefix_cache.size_info().cached_tokens


def reference_output(prompt_len: int, max_new: int) -> list[int]:
    scheduler = make_scheduler()
    req = make_req(prompt_len, max_new_tokens=max_new)
    scheduler.add(req)
    run_to_end(scheduler)
    return req.output_ids


def test_a_request_that_fails_twice_alone_is_aborted_and_the_others_finish():
    scheduler = make_scheduler(radix=False)
    good, bad = make_req(6, max_new_tokens=5), make_req(7, max_new_tokens=5)
    for req in (good, bad):
        scheduler.add(req)
    failures = 0
    while scheduler.has_work():
        out = scheduler.schedule()
        scheduler.pop_finished_outside_step()
        fake_forward(scheduler, out)
        if bad in out.reqs:  # the bad request breaks every forward pass it is in
            failures += 1
            aborted = scheduler.step_failed(out, RuntimeError("boom"))
        elif out:
            fake_sample(out)
            scheduler.update(out)
        scheduler.check_integrity()
    assert failures == 1 + MAX_FAILURES_ALONE and aborted == [bad]
    assert bad.finish_reason.type == "abort" and "boom" in bad.finish_reason.message
    assert isinstance(bad.error, RequestFault) and bad.row is None
    assert good.finish_reason.type == "length" and good.output_ids == reference_output(6, 5)
    assert used_slots(scheduler) == 0 and scheduler.stats.failed_steps == failures


def test_a_failing_row_aborts_its_request_only():
    scheduler = make_scheduler(radix=False)
    reqs = [make_req(4, max_new_tokens=3) for _ in range(3)]
    for req in reqs:
        scheduler.add(req)
    out = scheduler.schedule()
    fake_forward(scheduler, out)
    fake_sample(out, errors={reqs[1]: "sampling failed: NaN"})
    changed = scheduler.update(out)
    scheduler.check_integrity()
    assert reqs[1] in changed and reqs[1].finish_reason.message == "sampling failed: NaN"
    assert isinstance(reqs[1].error, RequestFault) and reqs[1].row is None
    run_to_end(scheduler)
    assert [r.finish_reason.type for r in reqs] == ["length", "abort", "length"]
    assert used_slots(scheduler) == 0


def test_output_processing_that_raises_aborts_that_request_only():
    scheduler = make_scheduler()
    reqs = [make_req(4, max_new_tokens=3), make_req(5, max_new_tokens=3, stop=("x",))]
    check = scheduler.stops.check

    def broken_for_stop_strings(req, num_new):
        if req.sampling.stop:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return check(req, num_new)

    scheduler.stops.check = broken_for_stop_strings
    for req in reqs:
        scheduler.add(req)
    run_to_end(scheduler)
    assert reqs[0].finish_reason.type == "length" and len(reqs[0].output_ids) == 3
    assert (
        reqs[1].finish_reason.type == "abort"
        and reqs[1].finish_reason.message
        == "processing this request's output failed (see the server log)"
    )
    assert scheduler.stats.request_faults == 1


def test_aborting_a_suspect_clears_it():
    scheduler = make_scheduler()
    reqs = [make_req(5, max_new_tokens=4) for _ in range(2)]
    for req in reqs:
        scheduler.add(req)
    fail_step(scheduler, RuntimeError("x"))
    scheduler.abort(reqs[0].rid)
    assert step(scheduler).reqs == [reqs[1]]
    run_to_end(scheduler)
    assert reqs[1].finish_reason.type == "length"


@pytest.mark.parametrize("radix", [True, False])
def test_the_integrity_check_catches_a_leaked_slot(radix):
    scheduler = make_scheduler(radix=radix)
    scheduler.add(make_req(4))
    step(scheduler)
    scheduler.cache.allocator.alloc(1)  # nobody owns it
    with pytest.raises(AssertionError, match="slot leak"):
        scheduler.check_integrity()


def test_fake_model_is_deterministic():
    req = make_req(3)
    assert next_token(req) == 103


@pytest.mark.parametrize("seed", range(4))
def test_random_step_failures_under_memory_pressure_keep_accounting_exact(seed):
    """Steps fail at random (20%) while a small pool forces retractions: after every step
    the pool accounting is exact; every request either finishes with exactly the tokens of
    a clean run or is aborted for failing twice alone; nothing leaks at the end."""
    rng = random.Random(seed)
    scheduler = make_scheduler(
        num_slots=120, radix=seed % 2 == 0, chunked_prefill_size=24, decode_reserve_ratio=0.0
    )
    reqs = [
        make_req(
            [rng.randrange(10, 90) for _ in range(rng.randrange(3, 30))],
            max_new_tokens=rng.randrange(1, 20),
        )
        for _ in range(12)
    ]
    for req in reqs:
        scheduler.add(req)
    for _ in range(3000):
        if not scheduler.has_work():
            break
        out = scheduler.schedule()
        scheduler.pop_finished_outside_step()
        fake_forward(scheduler, out)
        if out and rng.random() < 0.2:
            scheduler.step_failed(out, RuntimeError("chaos"))
        elif out:
            fake_sample(out)
            scheduler.update(out)
        scheduler.check_integrity()
    assert not scheduler.has_work()
    for req in reqs:
        if req.finish_reason.type == "abort":
            assert isinstance(req.error, RequestFault) and "ran alone" in req.finish_reason.message
            continue
        n = len(req.prompt_ids)
        assert req.output_ids == [100 + (n + k) % 50 for k in range(req.sampling.max_new_tokens)]
    assert sum(r.finish_reason.type != "abort" for r in reqs) >= 6
    assert scheduler.stats.failed_steps > 0 and scheduler.stats.retractions > 0
    assert used_slots(scheduler) == scheduler.cache.prefix_cache.size_info().cached_tokens
