"""Fair scheduling without a model (issue 51): while requests decode, a step's prefill is
sized from the measured pace to fit --max-step-ms (never below the floor), and one client's
large batch shares each step's prefill budget with the other clients' prompts. The step
seconds are given, never measured: nothing here depends on the machine's speed."""

from __future__ import annotations

from scheduler_fakes import fake_forward, fake_sample, make_req, make_scheduler, step

from spruce.runtime.scheduler.pace import PREFILL_FLOOR, StepPace
from spruce.runtime.scheduler.prefill import fair_split


def timed_step(scheduler, seconds_of):
    """One step with the fake model, reported to the scheduler as taking `seconds_of(out)`."""
    out = scheduler.schedule()
    scheduler.pop_finished_outside_step()
    if out:
        fake_forward(scheduler, out)
        fake_sample(out)
        scheduler.update(out)
        scheduler.record_step(out, seconds_of(out))
    scheduler.check_integrity()
    return out


def linear_cost(decode_s: float, token_s: float):
    """A fake machine: a step costs `decode_s` plus `token_s` per prefill token."""

    def seconds(out) -> float:
        prefill = sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1)
        return decode_s + token_s * prefill

    return seconds


def prefill_tokens(out) -> int:
    return sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1)


# -- the step's prefill, bounded by time while requests decode ---------------------------------


def test_a_mixed_steps_prefill_shrinks_to_fit_max_step_ms():
    scheduler = make_scheduler(num_slots=4096, chunked_prefill_size=200, max_step_ms=100)
    cost = linear_cost(decode_s=0.02, token_s=0.004)  # 100 ms: 20 prefill tokens beside a decode
    stream = make_req(8, max_new_tokens=200)
    scheduler.add(stream)
    for _ in range(3):
        timed_step(scheduler, cost)  # its prompt, then decodes
    for i in range(3):
        scheduler.add(make_req([1000 * (i + 1) + t for t in range(240)], max_new_tokens=0))
    steps = [timed_step(scheduler, cost) for _ in range(30)]
    assert all(any(s.req is stream for s in out.scheduled) for out in steps)
    sizes = [prefill_tokens(out) for out in steps]
    assert all(PREFILL_FLOOR <= size < 200 for size in sizes)  # never a whole chunk
    assert all(18 <= size <= 20 for size in sizes[10:])  # then each step fits 100 ms
    assert all(cost(out) <= 0.1 + 1e-9 for out in steps[10:])


def test_a_mixed_steps_prefill_never_goes_below_the_floor():
    scheduler = make_scheduler(num_slots=4096, chunked_prefill_size=512, max_step_ms=10)
    cost = linear_cost(decode_s=0.05, token_s=0.01)  # a decode alone is past 10 ms
    stream = make_req(8, max_new_tokens=200)
    scheduler.add(stream)
    timed_step(scheduler, cost)
    big = make_req(200, max_new_tokens=0)
    scheduler.add(big)
    sizes = [prefill_tokens(timed_step(scheduler, cost)) for _ in range(6)]
    assert all(size == PREFILL_FLOOR for size in sizes[2:])
    assert big.computed_len > 0 and stream.output_ids  # both progress


def test_without_decodes_a_step_takes_a_whole_chunk_and_max_step_ms_0_is_off():
    for max_step_ms, decoding in ((100, False), (0, True)):
        scheduler = make_scheduler(
            num_slots=4096, chunked_prefill_size=200, max_step_ms=max_step_ms
        )
        scheduler.pace.record(0.02, 0)
        scheduler.pace.record(1.0, 100)  # 10 ms a token: 100 ms would allow 8
        if decoding:
            scheduler.add(make_req(8, max_new_tokens=50))
            step(scheduler)
        scheduler.add(make_req(240, max_new_tokens=0))
        assert prefill_tokens(scheduler.schedule()) == 200


def test_the_pace_follows_recent_steps_and_ignores_tiny_samples():
    pace = StepPace()
    pace.record(0.01, 0)
    pace.record(0.01 + 0.5, 100)  # 5 ms a token
    first = pace.prefill_budget(0.11, 1024)
    assert first == 20
    pace.record(5.0, 1)  # one prefill token says nothing of the cost per token
    assert pace.prefill_budget(0.11, 1024) == first
    for _ in range(20):
        pace.record(0.01 + 1.0, 100)  # the machine got slower: 10 ms a token
    assert pace.prefill_budget(0.11, 1024) == 10


# -- one client's batch does not take every step -----------------------------------------------


def test_fair_split_gives_small_demands_all_and_shares_the_rest():
    assert fair_split({"a": 5000, "b": 20}, 1024) == {"b": 20, "a": 1004}
    assert fair_split({"a": 5000, "b": 5000}, 1024) == {"a": 512, "b": 512}
    assert fair_split({"a": 100, "b": 5000, "c": 5000}, 300) == {"a": 100, "b": 100, "c": 100}
    assert fair_split({"": 3000}, 1024) == {"": 1024}


def client_req(client: str, prompt: int, max_new_tokens: int = 0):
    req = make_req(prompt, max_new_tokens=max_new_tokens)
    req.client = client
    return req


def test_admission_interleaves_two_clients_prompts():
    scheduler = make_scheduler(
        num_slots=8192, max_requests=16, chunked_prefill_size=128, schedule_policy="fcfs"
    )
    batch = [client_req("heavy", [1000 * (i + 1) + t for t in range(200)]) for i in range(10)]
    for req in batch:
        scheduler.add(req)
    step(scheduler)  # the heavy batch alone: the whole budget
    others = [client_req("light", [50 + i] * 60, max_new_tokens=4) for i in range(3)]
    for req in others:
        scheduler.add(req)  # queued behind nine of the batch's prompts
    out = step(scheduler)
    light = [s for s in out.scheduled if s.req.client == "light"]
    heavy = [s for s in out.scheduled if s.req.client == "heavy"]
    assert sum(s.num_tokens for s in light) == 64 and sum(s.num_tokens for s in heavy) == 64
    while any(r.remaining > 1 for r in others):
        out = step(scheduler)
        assert any(s.req.client == "heavy" for s in out.scheduled)  # the batch progresses too
    assert all(r.output_ids for r in others)
    assert sum(r.finished for r in batch) < 4  # the light prompts did not wait for the batch


def test_one_client_alone_gets_the_whole_budget():
    scheduler = make_scheduler(num_slots=8192, max_requests=16, chunked_prefill_size=128)
    for _ in range(4):
        scheduler.add(client_req("heavy", 200))
    assert step(scheduler).num_tokens == 128


def test_a_second_clients_prompt_bounds_the_step_by_time_too():
    scheduler = make_scheduler(num_slots=8192, max_requests=16, chunked_prefill_size=200)
    scheduler.pace.record(0.02, 0)
    scheduler.pace.record(0.02 + 0.2, 100)  # 2 ms a prefill token: 40 ms allow 10
    scheduler.add(client_req("heavy", [1000 + t for t in range(240)]))
    assert prefill_tokens(scheduler.schedule()) == 200  # one client alone: a whole chunk
    scheduler = make_scheduler(num_slots=8192, max_requests=16, chunked_prefill_size=200)
    scheduler.pace.record(0.02, 0)
    scheduler.pace.record(0.02 + 0.2, 100)
    scheduler.add(client_req("heavy", [1000 + t for t in range(240)]))
    scheduler.add(client_req("light", [50] * 8, max_new_tokens=4))
    out = scheduler.schedule()
    assert prefill_tokens(out) == 10  # its first token does not wait for a whole chunk
    assert {s.req.client: s.num_tokens for s in out.scheduled} == {"heavy": 5, "light": 5}
